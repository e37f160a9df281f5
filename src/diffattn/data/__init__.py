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

_EXPORTS = {
    "DEFAULT_CORPUS_BYTES": "corpus",
    "EOS_TOKEN": "tokenizers",
    "BatchLoader": "loader",
    "DataConfig": "prepare",
    "DataStats": "prepare",
    "HFTokenizer": "tokenizers",
    "PreparedData": "prepare",
    "Shard": "shards",
    "ShardSet": "shards",
    "ShardWriter": "shards",
    "SourceStats": "sources",
    "TextError": "text_decoding",
    "TiktokenTokenizer": "tokenizers",
    "Tokenizer": "tokenizers",
    "TokenizerSpec": "tokenizers",
    "decode_utf8": "text_decoding",
    "default_corpus": "corpus",
    "documents_after_eos": "loader",
    "encode_batch": "tokenizers",
    "eval_batches": "loader",
    "fingerprint_sources": "sources",
    "is_validation_document": "shards",
    "iter_documents": "sources",
    "load_hf_tokenizer": "tokenizers",
    "load_prepared_tokenizer": "prepare",
    "load_tokenizer": "tokenizers",
    "parse_hf_spec": "sources",
    "parse_tokenizer_spec": "tokenizers",
    "prepare_data": "prepare",
    "read_file": "sources",
    "read_hf_dataset": "sources",
    "read_jsonl_file": "sources",
    "read_parquet_file": "sources",
    "read_text_file": "sources",
    "stdlib_files": "corpus",
    "tiktoken_to_hf": "tokenizers",
    "token_dtype": "shards",
    "train_bpe": "tokenizers",
    "write_token_shards": "shards",
}
"""Each public name and the submodule that defines it (imported on first use)."""

__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
