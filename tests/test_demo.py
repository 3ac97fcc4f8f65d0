"""The README's demo: SmolLM2 answers from kdn are identical to full-prefill answers, with a speedup."""

import re

import pytest

from kdn.demo import document, run_demo


def test_bundled_document_is_multi_thousand_tokens(smollm2):
    _, tokenizer = smollm2
    assert len(tokenizer(document()).input_ids) > 2500


@pytest.mark.slow
def test_demo_answers_match_and_reuse_the_document(smollm2, capsys):
    assert run_demo(num_questions=2, max_new_tokens=8, loaded=smollm2) == 0
    out = capsys.readouterr().out
    assert "answers identical to full prefill: yes" in out
    rows = [line.split() for line in out.splitlines() if re.match(r"^\s*[12] ", line)]
    assert int(rows[0][2]) == 0 and int(rows[1][2]) >= 2560  # question 2: the document came from kdn
