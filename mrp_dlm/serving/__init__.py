"""Serving in SGLang 0.5.23 (plugin `plugin.load` and `mrp serve`). Module map:
  plugin.py          entry point: what is registered (algorithms, architectures, hooks)
  sglang_process.py  door: version, registries, hooks, runtime context, TP group, MoE blocks
  sglang_forward.py  door: algorithm contract, ForwardBatch, runner, pools, verify rows
  config.py          the algorithms' YAML as a frozen dataclass; block size / mask id rules
  base.py            shared by the algorithms: launch and request errors, one forward
  speculative.py     MrpSpeculative (lossless: LowConfidence's output, greedy or seeded)
  direct.py          MrpDirect (lossy, up to 1 + K tokens per forward)
  remask.py          MrpRemask (the chain rule, or the v2 paper's residual veto)
  sampling.py        per-request temperature / top-k / top-p / seed of a batch
  head_host.py       the head on an SGLang model's shared weights, fingerprint-checked
  head_pool.py       the head's keys of earlier blocks: a pool by KV slot, the head's steps
  head_attention.py  the head's layers reading that pool in place, a chunk at a time
  head_tp.py         the head split over tensor-parallel ranks
  moe_cpu.py         the library's sparse MLP on SGLang's MoE tensors (CPU without kernels)
  sdar_config.py     model_types `sdar` and `sdar_moe` for transformers
  models/            SGLang model classes (our SDARForCausalLM, SDARMoeForCausalLM)
  stats.py           serving stats per algorithm: log line, metrics
  request_defaults.py  --preferred-sampling-params for what OpenAI requests leave out
  serve_config.py    what `mrp serve` takes (ServeConfig), light to import
  launch.py          ServeConfig -> the SGLang command, environment and YAML
  attention_backend.py  which attention backend `mrp serve` asks SGLang for, and why
  process.py         check its port, start it, wait until it answers, stop its whole tree
  server.py          SGLang's main process (`python -m mrp_dlm.serving.server`)
  cpu_standins.py    import stand-ins that let SGLang start on a CPU-only machine
Only the doors touch SGLang (docs/serving.md lists each touch); importing this imports none.
"""
