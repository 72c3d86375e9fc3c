"""The README's usage example runs as written and prints what the README says it prints.

The block is taken from README.md as it stands and run in a fresh process. The only change: the two
``from_pretrained`` downloads are answered locally (no hub here) by a byte-level tokenizer and a Qwen3 with the
real vocabulary size and small layers, so the example's data, arguments, collator, packing decisions and status
are those of the README.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"

OFFLINE = """
import tokenizers, torch, transformers

def _tokenizer(*args, **kwargs):
    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)} | {"<|endoftext|>": len(alphabet)}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>",
                                                eos_token="<|endoftext|>")

def _model(*args, dtype=None, **kwargs):
    config = transformers.Qwen3Config(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=1024, tie_word_embeddings=True)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)

transformers.AutoTokenizer.from_pretrained = _tokenizer
transformers.AutoModelForCausalLM.from_pretrained = _model
"""


def _usage_block() -> tuple[str, str]:
    text = README.read_text()
    usage = text[text.index("## Usage") :]
    code = re.search(r"```python\n(.*?)```", usage, re.S).group(1)
    printed = re.search(r"^# (\{.*\})$", code, re.M).group(1)
    return code, printed


def test_the_usage_example_prints_what_the_readme_shows(tmp_path):
    code, printed = _usage_block()
    assert 'from_pretrained("Qwen/Qwen3-0.6B"' in code and "fasttrain.Trainer(" in code
    done = subprocess.run(
        [sys.executable, "-c", OFFLINE + code], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip().splitlines()[-1] == printed
