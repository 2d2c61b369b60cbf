import sys, time, os
from kvserve import LLM, SamplingParams
streams, tokens = int(sys.argv[1]), int(sys.argv[2])
llm = LLM("smollm2-135m-instruct", num_kv_blocks=2048)
prompts = [f"Write a short story about a robot number {i}." for i in range(streams)]
sp = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)
t = time.perf_counter(); out = llm.generate(prompts, sp, use_tqdm=False); dt = time.perf_counter() - t
print(f"{os.environ.get('OMP_WAIT_POLICY','default'):8s} streams={streams} tok/s={streams*tokens/dt:.1f} wall={dt:.2f}")
