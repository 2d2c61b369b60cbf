"""Router CPU per request under uvicorn loop/http variants: python variant.py LOOP HTTP PORT WORKER"""
import sys, uvicorn
from kvserve.router.app import Router, RouterApp
from kvserve.router.policy import make_policy
loop, http, port, worker = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
uvicorn.run(RouterApp(Router([worker], make_policy("cache_aware"))), host="127.0.0.1", port=port,
            log_level="warning", loop=loop, http=http)
