"""The signal-driven row-parallel forward on GPUs: the GEMM feeds the CUDA IPC all-reduce
directly, one finished row block at a time.

    y = all_reduce(x_n @ W_n.T):
      producer (compute stream): kernels.linear_with_flags writes this rank's rows into its CUDA
          IPC staging buffer and adds 1 to flags[b] (release) per finished tile of row block b
      consumer (comm stream): ipc_all_reduce_flagged; its block b waits for flags[b] ==
          cdiv(N, 128), then reduces row block b from every rank's staging buffer into y

``signal_refusal`` (a plain function, tested as a table) says why the path cannot serve a call;
``signal_path`` gathers the facts, builds or finds the group's communicator and makes the ranks
agree. Opt-in (``FASTPAR_SIGNAL_OVERLAP=1``) until it has run on a GPU.
"""

from __future__ import annotations

import os

import torch

from fastpar.nn.streams import comm_stream

SIGNAL_BLOCK = 128  # rows (and columns) of the producer's tiles; a row block is 128 rows
SIGNAL_MAX_BLOCKS = 64  # the consumer kernel's grid limit (csrc/cuda: kMaxBlocks)
_SIGNAL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def signal_refusal(*, device: str, sp: bool, triton: str | None, ipc_max_bytes: int,
                   dtype: torch.dtype, rows: int, cols: int, sms: int,
                   weight_dtype: torch.dtype | None = None) -> str | None:
    """Why the signal-driven row forward cannot serve a call (None: it can). That path: the
    Triton GEMM (``kernels.linear_with_flags``) writes each rank's rows into its CUDA IPC staging
    buffer and publishes each finished row block; a one-shot consumer on another stream reduces
    a row block as soon as every rank published it, while later rows are still computed.
    ``triton``: why Triton cannot compile here (None: it can); ``ipc_max_bytes``: the group's
    cuda_ipc limit (0: no communicator); ``sms``: the GPU's multiprocessors."""
    if device != "cuda":
        return f"signal-driven path needs CUDA tensors, got {device}"
    if sp:
        return "signal-driven path: all-reduce only, not sequence parallelism's reduce-scatter"
    if triton:
        return f"signal-driven path needs compiled Triton: {triton}"
    if not ipc_max_bytes:
        return "signal-driven path needs the group's cuda_ipc communicator, which it has not"
    if dtype not in _SIGNAL_DTYPES:
        return f"signal-driven path reduces float32/float16/bfloat16, not {dtype}"
    if weight_dtype is not None and weight_dtype != dtype:
        return f"signal-driven path: input {dtype} and weight {weight_dtype} differ"
    esize = torch.empty((), dtype=dtype).element_size()
    if rows * cols * esize > ipc_max_bytes:
        return (f"signal-driven path: {rows} x {cols} x {esize} bytes exceed the cuda_ipc limit "
                f"of {ipc_max_bytes}")
    if cols * esize % 16:
        return f"signal-driven path: a row of {cols * esize} bytes is not a multiple of 16"
    blocks = -(-rows // SIGNAL_BLOCK)
    if blocks > SIGNAL_MAX_BLOCKS:
        return (f"signal-driven path: {rows} rows are {blocks} row blocks of {SIGNAL_BLOCK}; the "
                f"consumer takes at most {SIGNAL_MAX_BLOCKS}")
    if 2 * blocks > sms:
        return (f"signal-driven path: {blocks} waiting consumer blocks would hold over half of "
                f"the GPU's {sms} multiprocessors, which the GEMM needs")
    return None


def _triton_refusal() -> str | None:
    try:
        from fastpar.kernels import gemm
    except Exception as exc:  # noqa: BLE001 - ImportError, or a broken Triton install
        return f"Triton is not importable ({type(exc).__name__}: {exc})"
    return "Triton runs in its interpreter (TRITON_INTERPRET=1)" if gemm.INTERPRETED else None


def signal_path(x: torch.Tensor, weight: torch.Tensor, group, sp: bool):
    """``(communicator, description)`` when the signal-driven row forward serves this call,
    else ``(None, why not)``. Opt-in (``FASTPAR_SIGNAL_OVERLAP=1``) until it has run on a GPU.
    Collective over the group on CUDA (it may build the group's cuda_ipc communicator, and the
    ranks agree on the answer: a rank taking the flagged kernel alone would stall the others),
    so the caller asks once per kind of input, on every rank."""
    rows, cols = x.numel() // max(x.shape[-1], 1), weight.shape[0]
    facts = dict(device=x.device.type, sp=sp, dtype=x.dtype, rows=rows, cols=cols,
                 weight_dtype=weight.dtype)
    why = signal_refusal(**facts, triton=None, ipc_max_bytes=1 << 62, sms=1 << 30)
    if why is not None:  # refused before anything is built or imported (alike on every rank)
        return None, why
    if os.environ.get("FASTPAR_SIGNAL_OVERLAP", "0") != "1":
        return None, ("signal-driven path is opt-in until measured on a GPU "
                      "(FASTPAR_SIGNAL_OVERLAP=1)")
    from fastpar.comm.engines.cuda_ipc import CudaIpc, all_agree
    from fastpar.comm.state import current

    st = current()
    g, ranks, group_facts = st.resolve(group)
    comm = st.communicator(CudaIpc, g, ranks, x.device) if group_facts.same_host and \
        st.forced in (None, "cuda_ipc") else None
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    why = signal_refusal(**facts, triton=_triton_refusal(), sms=sms,
                         ipc_max_bytes=comm.max_bytes if comm is not None else 0)
    if not all_agree(why is None, g, x.device):
        return None, why or "signal-driven path: a peer cannot take it"
    return comm, "signal-driven: Triton GEMM -> CUDA IPC one-shot per finished row block"


def signal_row_forward(x2: torch.Tensor, weight: torch.Tensor, comm) -> torch.Tensor:
    """y = all_reduce(x2 @ weight.T) with the reduction of each finished row block running
    while the GEMM computes the next ones (see ``signal_refusal``)."""
    from fastpar.kernels import linear_with_flags

    rows, cols = x2.shape[0], weight.shape[0]
    flags = torch.zeros(-(-rows // SIGNAL_BLOCK), dtype=torch.int32, device=x2.device)
    out = torch.empty(rows, cols, dtype=x2.dtype, device=x2.device)
    staging = comm.staging(rows, cols, x2.dtype)  # the compute stream waits until it is free
    compute = torch.cuda.current_stream(x2.device)
    side = comm_stream(x2.device)
    side.wait_stream(compute)  # flags zeroed, out allocated, staging free (not the GEMM below)
    # The producer is launched first: any error, compile or host stall happens before a
    # consumer waits on it, and launches serialised (CUDA_LAUNCH_BLOCKING) still complete.
    linear_with_flags(x2, weight, flags, block_m=SIGNAL_BLOCK, block_n=SIGNAL_BLOCK, out=staging)
    with torch.cuda.stream(side):  # reduces each row block once every rank has published it,
        # while the GEMM on the compute stream still produces later ones
        comm.all_reduce_flagged(out, flags, SIGNAL_BLOCK, -(-cols // SIGNAL_BLOCK))
    compute.wait_stream(side)  # out (and flags) are only touched on the compute stream after
    return out
