"""SGLang model classes of the plugin. SGLang imports every module here and registers each
`EntryClass` by class name (SGLANG_EXTERNAL_MODEL_PACKAGE), so keep only models here."""
