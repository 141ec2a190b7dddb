"""The point-to-point transport between ranks: bytes from one rank to a neighbour, checked and
bounded, on the engine that serves that neighbour. What the bytes mean is the user's: the
pipeline's message protocol (headers, payload, ``Channels``) is ``fastpar/pipeline/``.

- ``base.py``: the send handle every engine returns, the header size;
- ``carriers.py``: batched ``isend``/``irecv`` on clones of a group (NCCL / gloo), the engine
  over fastpar's shared-memory rings, and a ring's one-batch ``shift``;
- ``routes.py``: which engine serves each neighbour (shm within a host, torch across), and
  opening them;
- ``shm_rings.py``, ``shm_rings_setup.py``: the native shared-memory rings and their set-up.
"""
