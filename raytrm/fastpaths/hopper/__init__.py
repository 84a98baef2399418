"""raytrm's CUDA C++ kernels for Hopper GPUs (sm_90a), built with nvcc where a Hopper GPU and nvcc are present.

The operations they serve (the library: library.py; the kernels' sources: csrc/):
- swiglu (gated.py): the SwiGLU's gate/up product with its gate in one kernel, bf16, hidden size 512.
- swiglu_down_backward (gated.py): the down projection's backward with the gate's backward in its epilogue.
- attention (rotary_qkv.py): the attention's qkv projection with RoPE in its epilogue, then Triton's attention
  kernels over the rotated projection.
"""

from raytrm.fastpaths.hopper import gated, library, rotary_qkv
from raytrm.fastpaths.registry import Backend

load = library.load

BACKENDS = (
    Backend("swiglu", "hopper", gated.swiglu_why_not, gated.swiglu),
    Backend("swiglu_down_backward", "hopper", gated.down_backward_why_not, gated.swiglu_down_backward),
    Backend("attention", "hopper", rotary_qkv.attention_why_not, rotary_qkv.attention),
)
