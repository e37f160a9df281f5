"""Data for diffattn: sources, tokenizers, token shards, the batch loader, the default corpus.

The trainer needs two calls::

    from diffattn.data import BatchLoader, DataConfig, eval_batches, prepare_data

    data = prepare_data(DataConfig())            # the embedded stdlib corpus, BPE 8192
    loader = BatchLoader(data.train, batch_size=32, seq_len=256, seed=0,
                         rank=rank, world_size=world_size)
    batch = next(loader)                         # LongTensor (32 // world_size, 256)
    for batch in eval_batches(data.valid, 32, 256, max_batches=20): ...

``data.tokenizer.vocab_size`` sizes the model's embedding; ``loader.state_dict()`` goes into
checkpoints. See ``docs/data.md``.
"""

from diffattn.lazy_exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    globals(),
    {
        "corpus": ("DEFAULT_CORPUS_BYTES", "default_corpus", "stdlib_files"),
        "loader": ("BatchLoader", "documents_after_eos", "eval_batches"),
        "prepare": (
            "DataConfig",
            "DataStats",
            "PreparedData",
            "load_prepared_tokenizer",
            "prepare_data",
        ),
        "shards": (
            "Shard",
            "ShardSet",
            "ShardWriter",
            "is_validation_document",
            "token_dtype",
            "write_token_shards",
        ),
        "sources": (
            "SourceStats",
            "fingerprint_sources",
            "iter_documents",
            "parse_hf_spec",
            "read_file",
            "read_hf_dataset",
            "read_jsonl_file",
            "read_parquet_file",
            "read_text_file",
        ),
        "text_decoding": ("TextError", "decode_utf8"),
        "tokenizers": (
            "EOS_TOKEN",
            "HFTokenizer",
            "TiktokenTokenizer",
            "Tokenizer",
            "TokenizerSpec",
            "encode_batch",
            "load_hf_tokenizer",
            "load_tokenizer",
            "parse_tokenizer_spec",
            "tiktoken_to_hf",
            "train_bpe",
        ),
    },
)
