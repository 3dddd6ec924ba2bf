"""Serving in SGLang 0.5.23: a plugin with MRP speculative and direct decoding.

Installed with the `sglang` extra and registered through the `sglang.srt.plugins` entry
point (`plugin.load`). Module map:
  plugin.py        entry point: algorithms into SGLang's registry, model package, hooks
  config.py        the algorithms' YAML as a frozen dataclass; block size / mask id rules
  base.py          shared by both algorithms: launch and request errors, one forward
  speculative.py   MrpSpeculative (lossless; == LowConfidence at its threshold, and the
                   library's seeded sampled decode for sampled requests); its draft and
                   accept are decoding/speculative.py's own functions
  sampling.py      per-request temperature / top-k / top-p / seed, attached to each batch
  direct.py        MrpDirect (lossy, up to 1 + K tokens per forward)
  verify_batch.py  K + 1 candidates as extra rows of one forward (SGLang internals, gated)
  head_host.py     the head on an SGLang model's shared weights; fingerprint-checked loading
  head_pool.py     the head's keys of earlier blocks: a pool by KV slot, the head's steps
  sdar_config.py   model_type `sdar` for transformers
  models/          SGLang model classes (our SDARForCausalLM)
  stats.py         serving stats per algorithm: a scheduler hook -> log line, metrics
  request_defaults.py  --preferred-sampling-params for what OpenAI requests leave out
`mrp serve` (run SGLang with flags chosen for the machine):
  launch.py        ServeConfig -> the SGLang command, environment and YAML
  process.py       check its port, start it, wait until it answers, stop its whole tree
  server.py        SGLang's main process (`python -m mrp_dlm.serving.server`)
  cpu_standins.py  import stand-ins that let SGLang start on a CPU-only machine

Imports flow one way: model <- decoding <- serving. Importing this package imports no
SGLang code; neither do plugin.py, config.py, sampling.py, stats.py, request_defaults.py, launch.py,
process.py and cpu_standins.py at import (they import SGLang inside the functions that
run in its processes); the algorithm and model modules do.

Deliberately not here: a server of our own (SGLang is the server), the draws themselves
(decoding/sampling.py).
"""
