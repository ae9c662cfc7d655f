"""Loading the models that ingest runs: real checkpoints, the packaged GGUF defaults, tiny random ones.

- :mod:`.registry`: the names (aliases, ``known_alias``) and ``load_model``, which resolves a name
  to a packaged GGUF model, a ``.gguf`` file, a local folder, a tiny model or a hub repository;
- :mod:`.gguf`: the packaged GGUF models and their conversion into cached safetensors folders;
- :mod:`.cache`: where the cache lives (``$ACTSTORE_CACHE``, else platformdirs' user cache folder)
  and the per-folder file locks that let concurrent processes share it;
- :mod:`.tiny`: tiny random-weight models built from configs, and their tokenizer;
- :mod:`.base`: ``ModelError``, ``LoadedModel``, ``weight_hash``.

Library code here reports through ``logging`` (logger names ``actstore.ingest.models.*``) and never prints.
"""
