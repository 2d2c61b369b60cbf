"""Which vector registers the sampled instructions of OpenVINO's CPU plugin use. Arguments: the plugin library and a
file of perf report rows (percent, then the sampled address); each address is disassembled with objdump."""
import collections, subprocess, sys
plugin, report = sys.argv[1], sys.argv[2]
tot = collections.Counter()
for line in open(report):
    parts = line.split()
    if len(parts) < 2 or not parts[-1].startswith("0x"):
        tot["named symbols"] += float(parts[0].rstrip('%')); continue
    addr, pct = int(parts[-1], 16), float(parts[0].rstrip('%'))
    out = subprocess.run(['objdump', '-d', '--no-show-raw-insn', f'--start-address={addr}',
                          f'--stop-address={addr + 16}', plugin], capture_output=True, text=True).stdout
    ins = [l for l in out.splitlines() if l.strip().startswith(format(addr, 'x') + ':')]
    txt = ins[0] if ins else '?'
    tot['zmm' if 'zmm' in txt else 'ymm' if 'ymm' in txt else 'xmm' if 'xmm' in txt else 'scalar/other'] += pct
print({k: round(v, 1) for k, v in tot.items()}, "percent of all samples")
