"""A trickle of one-block requests and the KV pool's resident memory: the process's RSS growth over N short
requests one after another (SmolLM2 as shipped, its default 2 GiB KV budget, which is mapped lazily).
usage: PYTHONPATH=<tree> python3 kv_resident.py [N]"""
import sys
from kvserve import LLM, SamplingParams


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


num_requests = int(sys.argv[1]) if len(sys.argv) > 1 else 600
llm = LLM("smollm2-135m-instruct")
params = SamplingParams(max_tokens=2, temperature=0)
llm.generate("hi", params, use_tqdm=False)
before = rss_mib()
for i in range(num_requests):
    llm.generate(f"hi {i}", params, use_tqdm=False)
stats = llm.stats()
print(f"{num_requests} requests: RSS {before:.0f} -> {rss_mib():.0f} MiB (+{rss_mib() - before:.0f}); "
      f"KV blocks cached {stats['prefix_cache_blocks']} of {stats['num_blocks_total']}")
