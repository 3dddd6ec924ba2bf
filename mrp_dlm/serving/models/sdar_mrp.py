"""Our `SDARForCausalLM`: SGLang's SDAR model with the MRP head on board
(`sglang_forward.MrpModel`: hidden states and SUBS on dLLM forwards, the head attached
after the weights load). It keeps SGLang's class name, on which SGLang's model registry and
its block-size/mask table key.

The head runs as plain PyTorch (no radix attention); its keys of earlier blocks live in the
algorithms' own pool (`head_pool.py`), which the algorithms fill, since every dLLM forward,
prompt blocks included, goes through them. Under tensor parallelism every rank holds its
share of the head (`head_tp.py`) and gathers the head's logits over the lm_head's
vocabulary shards, as SGLang's logits processor does for the backbone's.

Deliberately not here: the decoding algorithms (`speculative.py`, `direct.py`); SGLang's
names (`sglang_forward.py`).
"""

from __future__ import annotations

from mrp_dlm.serving.sglang_forward import MrpModel, sglang_model_class


class SDARForCausalLM(MrpModel, sglang_model_class("SDARForCausalLM")):
    pass


EntryClass = SDARForCausalLM
