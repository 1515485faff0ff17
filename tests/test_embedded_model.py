from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

from lit_cancel.hub import ASSETS, resolve_model_path
from lit_cancel.tokenizer import build_char_tokenizer


def test_embedded_model_loads_through_transformers_and_fits_the_size_budget():
    folder = resolve_model_path("embedded:tiny-adder")
    size = sum(f.stat().st_size for f in Path(folder).iterdir())
    assert size <= 10 * 2**20
    model = AutoModelForCausalLM.from_pretrained(folder)
    parameters = sum(p.numel() for p in model.parameters())
    assert 1_000_000 <= parameters <= 5_000_000
    assert model.config.model_type == "qwen2"


def test_embedded_tokenizer_is_the_character_tokenizer():
    shipped = AutoTokenizer.from_pretrained(ASSETS / "tiny-adder")
    built = build_char_tokenizer()
    assert shipped.get_vocab() == built.get_vocab()
    text = "047+385=7+5+0=12,4+8+1=13,0+3+1=4|432"
    assert shipped(text)["input_ids"] == built(text)["input_ids"] and len(shipped(text)["input_ids"]) == len(text)
    assert shipped.decode(shipped(text)["input_ids"]) == text
    assert shipped.eos_token == "<eos>" and shipped.pad_token == "<pad>"


def test_embedded_scaffold_model_fits_the_budget_and_follows_the_format_it_is_asked_for():
    from lit_cancel.tasks import SCAFFOLD_TEXT, VERBOSE_TEXT, ScaffoldedAdditionTask

    folder = resolve_model_path("embedded:tiny-scaffold")
    assert sum(f.stat().st_size for f in Path(folder).iterdir()) <= 10 * 2**20
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.get_vocab() == build_char_tokenizer().get_vocab()
    for scaffold, spread in [(0, 0), (12, 4), (24, 8)]:
        task = ScaffoldedAdditionTask(scaffold=scaffold, spread=spread, train_size=10, val_size=8)
        records = task.val_records()
        prompts = tokenizer([r["prompt"] for r in records], return_tensors="pt")
        output = model.generate(**prompts, max_new_tokens=96, do_sample=False, eos_token_id=tokenizer.eos_token_id)
        texts = tokenizer.batch_decode(output[:, prompts["input_ids"].shape[1] :], skip_special_tokens=True)
        for text in texts:
            assert text.startswith(SCAFFOLD_TEXT[:scaffold]) and text[scaffold : scaffold + 1].isdigit(), text
            steps = text.split("|")[0][scaffold:].split(",")
            assert len(steps) == 3 and all(s.endswith(VERBOSE_TEXT[:spread]) or s[-1].isdigit() for s in steps), text
        # a warm start: greedy decoding is right for some problems (0.4 to 0.98 of them, by setting)
        assert sum(task.reward(r, t) for r, t in zip(records, texts)) >= 2
