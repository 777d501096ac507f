"""What 'auto' resolves to on each platform a step can be compiled for, pinned: the attention
implementation and whether the loss slices its logits. The choices follow the compiled steps'
figures in docs/scaling.md ("Defaults per platform", `benchmarks/plan_defaults.py`); the
platform is the active mesh's (an abstract one here, as a compile-only topology gives)."""

import contextlib

import jax
import pytest

from transformer_jax import kernels
from transformer_jax.layers import losses

# (platform, causal, dropout) -> attention 'auto' resolves to
ATTENTION = {
    ('cpu', True, False): 'chunked',
    ('cpu', False, False): 'chunked',
    ('gpu', True, False): 'cudnn',
    ('gpu', False, False): 'cudnn',
    ('tpu', True, False): 'pallas',
    ('tpu', False, False): 'chunked',
}
# a small table (Multi30k's 8,000 x 256) and GPT-2's 50,257 x 768: sliced?
SLICED = {'cpu': (True, False), 'gpu': (False, False), 'tpu': (False, False)}


@contextlib.contextmanager
def compiling_for(platform: str):
  if platform == 'cpu':
    yield
    return
  kind = {'gpu': 'NVIDIA H100 80GB HBM3', 'tpu': 'TPU v5 lite'}[platform]
  device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=None, platform=platform)
  with jax.sharding.use_abstract_mesh(
      jax.sharding.AbstractMesh((2,), ('data',), abstract_device=device)):
    yield


@pytest.mark.parametrize('platform', ['cpu', 'gpu', 'tpu'])
def test_auto_attention_per_platform(platform):
  with compiling_for(platform):
    for causal in (True, False):
      assert kernels.auto_implementation(causal=causal) == ATTENTION[(platform, causal, False)]
      assert kernels.auto_implementation(dropout=True, causal=causal) == 'chunked'


@pytest.mark.parametrize('platform', ['cpu', 'gpu', 'tpu'])
def test_the_loss_slices_its_logits_on_cpu_only(platform):
  with compiling_for(platform):
    assert (losses._slicing_pays(8000, 256), losses._slicing_pays(50257, 768)) == SLICED[platform]
