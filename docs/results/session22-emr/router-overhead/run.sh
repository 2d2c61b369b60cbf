cd "$(git rev-parse --show-toplevel)"
for r in 1 2; do
PYTHONPATH=. python benchmarks/router.py overhead --streams 64 --rounds 4 --json docs/results/session22-emr/router-overhead/s64-shared-$r.json
PYTHONPATH=. python benchmarks/router.py overhead --streams 64 --rounds 4 --router-cpus 1 --json docs/results/session22-emr/router-overhead/s64-pinned-$r.json
done
PYTHONPATH=. python benchmarks/router.py overhead --streams 1 --rounds 3 --json docs/results/session22-emr/router-overhead/s1-shared.json
PYTHONPATH=. python benchmarks/router.py overhead --streams 64 --rounds 4 --first-chunk-ms 20 --chunk-ms 5 --json docs/results/session22-emr/router-overhead/s64-fast-shared.json
PYTHONPATH=. python benchmarks/router.py overhead --streams 64 --rounds 4 --first-chunk-ms 20 --chunk-ms 5 --router-cpus 1 --json docs/results/session22-emr/router-overhead/s64-fast-pinned.json
PYTHONPATH=. python benchmarks/router.py overhead --streams 64 --rounds 3 --first-chunk-ms 0 --chunk-ms 0 --json docs/results/session22-emr/router-overhead/s64-atonce-shared.json
