"""The bench's inputs: the stdlib corpus, the cached tokenizer, the examples built from each dataset kind."""

from __future__ import annotations

import json

import pytest

from fasttrain.bench import corpus, data, tokenizer


def test_stdlib_files_are_deterministic_and_exclude_site_packages():
    files = corpus.stdlib_files()
    assert files == corpus.stdlib_files()
    assert len(files) > 100
    root = corpus.stdlib_root()
    assert all(f.suffix == ".py" for f in files)
    assert not any({"site-packages", "dist-packages"} & set(f.relative_to(root).parts) for f in files)
    assert files != sorted(files)  # shuffled, so that a prefix mixes packages


def test_top_level_blocks_keep_decorators_with_their_definition():
    text = "import os\n\n\n@decorator\n@other(1)\ndef f():\n    return 1\n\n\nclass C:\n    def m(self):\n        pass\n"
    blocks = corpus.top_level_blocks(text)
    assert blocks == [
        "import os\n\n\n",
        "@decorator\n@other(1)\ndef f():\n    return 1\n\n\n",
        "class C:\n    def m(self):\n        pass\n",
    ]
    assert "".join(blocks) == text


def test_chunk_blocks_joins_until_full_and_truncates_long_blocks():
    blocks = [[1] * 3, [2] * 4, [3] * 2, [4] * 12, [5] * 5]
    assert list(data._chunk_blocks(blocks, 8)) == [[1] * 3 + [2] * 4, [3] * 2, [4] * 8, [5] * 5]


@pytest.fixture(scope="module")
def small_tokenizer(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("FASTTRAIN_CACHE", str(cache))
    path, cached = tokenizer.load_or_train(vocab_size=600, train_bytes=150_000)
    assert not cached and path.is_relative_to(cache)
    again, cached = tokenizer.load_or_train(vocab_size=600, train_bytes=150_000)
    assert cached and again == path
    other, cached = tokenizer.load_or_train(vocab_size=700, train_bytes=150_000)
    assert not cached and other != path  # settings are part of the cache key
    mp.undo()
    return tokenizer.as_transformers_tokenizer(path)


def test_tokenizer_round_trips_code(small_tokenizer):
    source = "def add(a, b):\n    return a + b  # ünïcode\n"
    ids = small_tokenizer(source, add_special_tokens=False)["input_ids"]
    assert small_tokenizer.decode(ids) == source
    assert len(small_tokenizer) == 600
    assert small_tokenizer.pad_token_id is not None and small_tokenizer.eos_token_id is not None


def test_default_examples_vary_in_length_within_bounds(small_tokenizer):
    examples = data.build_examples(data.DEFAULT, small_tokenizer, 64, 40)
    lengths = [len(e) for e in examples]
    assert len(examples) == 40
    assert all(data.MIN_TOKENS <= n <= 64 for n in lengths)
    assert min(lengths) < 64 and max(lengths) == 64  # padded batches, not packed ones
    assert examples == data.build_examples(data.DEFAULT, small_tokenizer, 64, 40)


def test_local_jsonl_txt_and_parquet(small_tokenizer, tmp_path):
    rows = [{"text": f"def f{i}():\n    return {i} * {i} + {i}\n" * (i + 1)} for i in range(6)]
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    from_jsonl = data.build_examples(str(jsonl), small_tokenizer, 48, 100)
    assert len(from_jsonl) == 6 and all(len(e) <= 48 for e in from_jsonl)

    import datasets

    parquet = tmp_path / "d.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(parquet))
    assert data.build_examples(str(parquet), small_tokenizer, 48, 100) == from_jsonl

    txt = tmp_path / "d.txt"
    txt.write_text("\n".join("x = " + " + ".join(str(j) for j in range(i + 10)) for i in range(5)) + "\n\n")
    assert len(data.build_examples(str(txt), small_tokenizer, 48, 100)) == 5


def test_pretokenized_input_ids_are_used_as_is(small_tokenizer, tmp_path):
    path = tmp_path / "ids.jsonl"
    path.write_text(
        json.dumps({"input_ids": list(range(30))}) + "\n" + json.dumps({"input_ids": [1, 2]}) + "\n"
    )
    assert data.build_examples(str(path), small_tokenizer, 20, 10) == [list(range(20))]


def test_dataset_without_text_column_is_a_clear_error(small_tokenizer, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "hi", "answer": "there"}) + "\n")
    with pytest.raises(data.DatasetError, match=r"no 'text' or 'input_ids' column \(columns: .*prompt"):
        data.build_examples(str(path), small_tokenizer, 32, 4)


def test_unreadable_dataset_file_is_a_clear_error(small_tokenizer, tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(data.DatasetError, match="could not be loaded"):
        data.build_examples(str(path), small_tokenizer, 32, 4)


def test_lognormal_lengths_are_seeded_clipped_and_centred_on_the_median():
    lengths = data.lognormal_lengths(4000, 1024, seed=3)
    assert lengths == data.lognormal_lengths(4000, 1024, seed=3)
    assert lengths != data.lognormal_lengths(4000, 1024, seed=4)
    assert min(lengths) >= data.MIN_TOKENS and max(lengths) <= 1024
    assert max(lengths) == 1024 and min(lengths) == data.MIN_TOKENS  # the long tail and the floor both clip
    ordered = sorted(lengths)
    assert 160 <= ordered[len(ordered) // 2] <= 200  # median 180


def test_lognormal_examples_cut_the_token_stream_to_the_drawn_lengths(small_tokenizer):
    examples = data.build_examples(data.DEFAULT, small_tokenizer, 256, 30, data.LOGNORMAL, seed=1)
    assert [len(e) for e in examples] == data.lognormal_lengths(30, 256, seed=1)
    assert examples == data.build_examples(data.DEFAULT, small_tokenizer, 256, 30, data.LOGNORMAL, seed=1)
    # consecutive pieces of one stream: the first example starts where the corpus starts
    natural = data.build_examples(data.DEFAULT, small_tokenizer, 4096, 1)
    assert examples[0] == natural[0][: len(examples[0])]


def test_lognormal_examples_from_a_file_and_unknown_kinds(small_tokenizer, tmp_path):
    path = tmp_path / "ids.jsonl"
    path.write_text(
        "".join(json.dumps({"input_ids": list(range(i * 100, i * 100 + 90))}) + "\n" for i in range(40))
    )
    examples = data.build_examples(str(path), small_tokenizer, 64, 5, data.LOGNORMAL, seed=0)
    assert [len(e) for e in examples] == data.lognormal_lengths(5, 64, seed=0)
    assert examples[0][:3] == [0, 1, 2]
    with pytest.raises(data.DatasetError, match="--lengths must be one of natural, lognormal"):
        data.build_examples(data.DEFAULT, small_tokenizer, 64, 5, "uniform")
