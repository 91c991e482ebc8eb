"""The data pipeline: raw text -> token shards -> batches, resumable exactly.

    tokenizer   byte-level BPE (trained here; nothing is downloaded), or an existing tokenizer.json
    prepare     `python -m data.prepare`: text files / objects -> shards + manifest, in N processes
    readers     the input formats (text, JSON lines, Parquet, `datasets` Arrow): files -> documents
    shards      the shard format: write, read, verify (local or any fsspec URL)
    stream      the global seeded order, rank slices, sequence packing, the resumable state
    loader      BatchLoader: worker processes that read ahead without changing the batches
    corpus      the built-in corpus (the Python standard library's sources)
"""
