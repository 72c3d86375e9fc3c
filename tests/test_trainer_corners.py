"""Corners where fasttrain must give transformers' answer, checked against transformers itself."""

from __future__ import annotations

import pytest
import transformers

import _tiny as tiny
import fasttrain

pytestmark = [pytest.mark.dropin, pytest.mark.gpu_versions, pytest.mark.numeric]


def _outcome(cls, tmp_path, dataset, **args):
    tok = tiny.tokenizer()
    try:
        trainer = cls(
            model=tiny.model("llama"),
            args=tiny.training_args(str(tmp_path / cls.__module__), **args),
            train_dataset=dataset,
            data_collator=transformers.DataCollatorForSeq2Seq(tok, padding=True),
            processing_class=tok,
        )
        trainer.train()
    except Exception as err:  # the outcome compared is the exception's type
        return type(err)
    return trainer.state.global_step


@pytest.mark.parametrize("with_length", [False, True])
@pytest.mark.parametrize("strategy", ["group_by_length", "random"])
def test_an_empty_training_set_fails_as_under_transformers(tmp_path, with_length, strategy):
    empty = tiny.dataset(with_length=with_length).select([])
    ref = _outcome(transformers.Trainer, tmp_path, empty, train_sampling_strategy=strategy)
    ours = _outcome(fasttrain.Trainer, tmp_path, empty, train_sampling_strategy=strategy)
    assert isinstance(ref, type) and issubclass(ref, Exception), ref
    assert ours is ref
