"""gated_delta: Gated DeltaNet (GDN) and Kimi Delta Attention (KDA) recurrences, chunkwise.

    from aiinfra_jax.kernels.gated_delta import gated_delta_rule

g of shape [B,T,HV] gives GDN, [B,T,HV,K] gives KDA (see api.py and reference.py).
"""

from .api import gated_delta_rule
from .reference import document_index, gated_delta_rule_reference

__all__ = ["gated_delta_rule", "gated_delta_rule_reference", "document_index"]
