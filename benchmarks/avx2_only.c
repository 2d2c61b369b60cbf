/* An LD_PRELOAD library that shows a process, and every process it starts, an x86-64 CPU without AVX-512, AMX
 * or the AVX-VNNI family: an AVX2 + FMA CPU such as AMD's Zen 2, on an AVX-512 machine.
 *
 * Why: ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS and ONEDNN_MAX_CPU_ISA cap the libraries that read them,
 * but a peer that asks the CPU itself (OpenVINO's CPU plugin picks its kernels by CPUID) still runs AVX-512
 * under them. Every program picks its code paths by the CPUID instruction, so this library makes that
 * instruction trap (Linux's CPUID faulting, arch_prctl(ARCH_SET_CPUID, 0), where the CPU and hypervisor
 * offer it: the "cpuid_fault" flag in /proc/cpuinfo) and answers it with the AVX-512 feature bits cleared.
 *
 * How: the constructor turns faulting on for the main thread before the program's own code runs; threads and
 * forked children inherit it, and execve resets it, where LD_PRELOAD loads this library again. A CPUID then
 * raises SIGSEGV; the handler runs the real instruction with faulting briefly off for its thread, clears the
 * bits, writes the registers and steps over the two-byte instruction. Other faults go to the handler the
 * program installed (sigaction is wrapped so that ours stays first) or to the default action. CPUID runs at
 * start-up, when libraries pick their kernels, so the trap costs nothing in the measured loops.
 *
 * What it cannot hide: XGETBV still reports the ZMM register state enabled (programs also need the CPUID bit,
 * which is cleared), and /proc/cpuinfo still lists the flags (glibc's own string functions are capped with
 * GLIBC_TUNABLES by avx2_only.sh; kvserve's kernels by KVSERVE_CPU_ISA=avx2).
 */
#define _GNU_SOURCE
#include <asm/prctl.h>
#include <cpuid.h>
#include <dlfcn.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

/* leaf 7, subleaf 0: EBX AVX512F, DQ, IFMA, PF, ER, CD, BW, VL */
#define L7_EBX_HIDDEN ((1u << 16) | (1u << 17) | (1u << 21) | (1u << 26) | (1u << 27) | (1u << 28) | (1u << 30) \
                       | (1u << 31))
/* ECX AVX512_VBMI, VBMI2, VNNI, BITALG, VPOPCNTDQ */
#define L7_ECX_HIDDEN ((1u << 1) | (1u << 6) | (1u << 11) | (1u << 12) | (1u << 14))
/* EDX AVX512_4VNNIW, 4FMAPS, VP2INTERSECT, AMX-BF16, AVX512_FP16, AMX-TILE, AMX-INT8 */
#define L7_EDX_HIDDEN ((1u << 2) | (1u << 3) | (1u << 8) | (1u << 22) | (1u << 23) | (1u << 24) | (1u << 25))
/* leaf 7, subleaf 1: EAX AVX-VNNI, AVX512_BF16, AVX-IFMA; EDX AVX-VNNI-INT8, AVX-NE-CONVERT, AVX10 */
#define L7S1_EAX_HIDDEN ((1u << 4) | (1u << 5) | (1u << 23))
#define L7S1_EDX_HIDDEN ((1u << 4) | (1u << 5) | (1u << 19))

static struct sigaction program_action; /* the program's SIGSEGV handler, SIG_DFL until it installs one */
static int (*real_sigaction)(int, const struct sigaction *, struct sigaction *);

static long set_cpuid_enabled(int enabled) { return syscall(SYS_arch_prctl, ARCH_SET_CPUID, enabled); }

static void hide_features(uint32_t leaf, uint32_t subleaf, uint32_t regs[4]) {
    if (leaf == 7 && subleaf == 0) {
        regs[1] &= ~L7_EBX_HIDDEN;
        regs[2] &= ~L7_ECX_HIDDEN;
        regs[3] &= ~L7_EDX_HIDDEN;
    } else if (leaf == 7 && subleaf == 1) {
        regs[0] &= ~L7S1_EAX_HIDDEN;
        regs[3] &= ~L7S1_EDX_HIDDEN;
    } else if (leaf == 0x1d || leaf == 0x1e || leaf == 0x24) { /* AMX tile and AVX10 information */
        memset(regs, 0, 4 * sizeof regs[0]);
    }
}

static void forward(int sig, siginfo_t *info, void *context) {
    if (program_action.sa_flags & SA_SIGINFO) {
        program_action.sa_sigaction(sig, info, context);
    } else if (program_action.sa_handler != SIG_DFL && program_action.sa_handler != SIG_IGN) {
        program_action.sa_handler(sig);
    } else { /* the default action: die of this signal once the handler returns and the fault repeats */
        struct sigaction dfl = {.sa_handler = SIG_DFL};
        real_sigaction(SIGSEGV, &dfl, NULL);
    }
}

static void on_segv(int sig, siginfo_t *info, void *context) {
    ucontext_t *uc = context;
    greg_t *gregs = uc->uc_mcontext.gregs;
    const unsigned char *ip = (const unsigned char *)gregs[REG_RIP];
    if (info->si_code != SI_KERNEL || ip[0] != 0x0f || ip[1] != 0xa2) { /* not a CPUID that trapped */
        forward(sig, info, context);
        return;
    }
    uint32_t leaf = (uint32_t)gregs[REG_RAX], subleaf = (uint32_t)gregs[REG_RCX], regs[4];
    set_cpuid_enabled(1);
    __cpuid_count(leaf, subleaf, regs[0], regs[1], regs[2], regs[3]);
    set_cpuid_enabled(0);
    hide_features(leaf, subleaf, regs);
    gregs[REG_RAX] = regs[0]; /* CPUID zero-extends into the 64-bit registers, as these assignments do */
    gregs[REG_RBX] = regs[1];
    gregs[REG_RCX] = regs[2];
    gregs[REG_RDX] = regs[3];
    gregs[REG_RIP] += 2;
}

/* The program's own SIGSEGV handler, by sigaction or signal, is kept for faults that are not CPUID; ours stays
 * installed. */
int sigaction(int sig, const struct sigaction *action, struct sigaction *old) {
    if (sig != SIGSEGV) return real_sigaction(sig, action, old);
    if (old) *old = program_action;
    if (action) program_action = *action;
    return 0;
}

sighandler_t signal(int sig, sighandler_t handler) {
    struct sigaction action = {.sa_handler = handler, .sa_flags = SA_RESTART}, old;
    sigemptyset(&action.sa_mask);
    return sigaction(sig, &action, &old) == 0 ? old.sa_handler : SIG_ERR;
}

__attribute__((constructor)) static void install(void) {
    real_sigaction = (int (*)(int, const struct sigaction *, struct sigaction *))dlsym(RTLD_NEXT, "sigaction");
    struct sigaction ours = {.sa_sigaction = on_segv, .sa_flags = SA_SIGINFO | SA_NODEFER};
    sigemptyset(&ours.sa_mask);
    if (!real_sigaction || real_sigaction(SIGSEGV, &ours, &program_action) != 0 || set_cpuid_enabled(0) != 0) {
        fprintf(stderr, "avx2_only: this CPU or kernel offers no CPUID faulting; refusing to run unmasked\n");
        _exit(97);
    }
}
