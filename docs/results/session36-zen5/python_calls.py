import cProfile, pstats, sys, random, io
import torch
from kvserve import LLM, SamplingParams
torch.manual_seed(0)
torch.set_num_threads(1)
llm = LLM(sys.argv[1], dtype="float32", max_num_seqs=256, num_kv_blocks=4096, max_model_len=512)
rng = random.Random(0)
prompts = [{"prompt_token_ids": [rng.randrange(3, 49000) for _ in range(128)]} for _ in range(256)]
params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
llm.generate(prompts[:8], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
pr = cProfile.Profile()
pr.enable()
llm.generate(prompts, params, use_tqdm=False)
pr.disable()
st = pstats.Stats(pr)
print("total calls", st.total_calls)
s = io.StringIO()
pstats.Stats(pr, stream=s).sort_stats("ncalls").print_stats(40)
print(s.getvalue())
