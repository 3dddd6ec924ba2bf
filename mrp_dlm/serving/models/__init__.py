"""SGLang model classes of the plugin. SGLang imports every module here and registers each
`EntryClass` by class name (SGLANG_EXTERNAL_MODEL_PACKAGE), so keep only models here.

A new MRP architecture: its SGLang module in `sglang_process.MODEL_BASES` (which also makes
it an MRP architecture for the plugin's hooks) and a module here whose class is
`MrpModel` on `sglang_model_class(name)`, as `sdar_mrp.py`."""
