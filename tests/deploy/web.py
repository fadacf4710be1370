"""The deploy tests' one HTTP client.

httpx.get and httpx.post build a client per call, and each client loads the CA bundle into a new SSL context: about
20 ms of CPU, spent again by every request and poll of these tests. Keep-alive is off and the pool unbounded, so
each request still opens a connection of its own, as those calls do, and any number run at once.
"""

import httpx

HTTP = httpx.Client(limits=httpx.Limits(max_connections=None, max_keepalive_connections=0))
