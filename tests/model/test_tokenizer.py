"""Tokenizer.from_dir reads a model directory the way transformers does: BOS once, the
full EOS set, chat templates rendered in a sandbox, and a clear error for each broken file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from triollm.errors import FieldError, ModelLoadError, UserError
from triollm.model.tokenizer import ChatTemplateError, Tokenizer

CORPUS = ["Hello world, the quick brown fox. Emoji 😀 and 中文 too.", "the cat sat"] * 10
SPECIALS = ["<s>", "</s>", "<|eot|>", "<pad>"]

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('the system message must come first') }}{% endif %}"
    "<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def write_model(
    d: Path,
    config: dict[str, Any] | None = None,
    *,
    model_config: dict[str, Any] | None = None,
    generation_config: dict[str, Any] | None = None,
    bos_post_processor: bool = False,
) -> Path:
    """A model directory with a tiny trained byte-level BPE and the given JSON files."""
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    hf.train_from_iterator(CORPUS, trainer)
    if bos_post_processor:  # Llama 3 style: the post-processor adds BOS, no config flag
        hf.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)]
        )
    d.mkdir(parents=True, exist_ok=True)
    hf.save(str(d / "tokenizer.json"))
    if config is not None:
        (d / "tokenizer_config.json").write_text(json.dumps(config))
    if model_config is not None:
        (d / "config.json").write_text(json.dumps(model_config))
    if generation_config is not None:
        (d / "generation_config.json").write_text(json.dumps(generation_config))
    return d


BASE = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}


def test_bos_is_prepended_exactly_once(tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(write_model(tmp_path, BASE))
    assert tok.bos_token_id == 0 and tok.add_bos
    ids = tok.encode("the cat")
    assert ids[0] == 0 and ids.count(0) == 1
    assert tok.encode("<s>the cat") == ids  # text that already starts with BOS keeps one
    assert tok.encode("the cat", add_special_tokens=False) == ids[1:]
    assert tok.decode(ids) == "the cat"  # special tokens are skipped when decoding


def test_add_bos_token_false_is_respected(tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(write_model(tmp_path, {**BASE, "add_bos_token": False}))
    assert tok.encode("the cat") == tok.encode("the cat", add_special_tokens=False)


def test_a_post_processor_that_adds_bos_counts_without_the_config_flag(tmp_path: Path) -> None:
    config = {"bos_token": "<s>", "eos_token": "</s>"}
    with_pp = Tokenizer.from_dir(write_model(tmp_path / "a", config, bos_post_processor=True))
    without = Tokenizer.from_dir(write_model(tmp_path / "b", config))
    assert with_pp.add_bos and not without.add_bos
    assert with_pp.encode("cat")[0] == 0 and with_pp.encode("cat").count(0) == 1


def test_special_tokens_may_be_added_token_dicts(tmp_path: Path) -> None:
    config = {"bos_token": {"content": "<s>", "lstrip": False}, "eos_token": {"content": "</s>"}}
    tok = Tokenizer.from_dir(write_model(tmp_path, config))
    assert tok.bos_token_id == 0
    assert tok.eos_token_ids == {1}


def test_eos_ids_are_the_union_of_every_config(tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(
        write_model(
            tmp_path,
            BASE,
            model_config={"eos_token_id": [1, 2]},
            generation_config={"eos_token_id": 3},
        )
    )
    assert tok.eos_token_ids == {1, 2, 3}


def test_bos_falls_back_to_config_json_when_the_tokenizer_config_is_absent(
    tmp_path: Path,
) -> None:
    tok = Tokenizer.from_dir(write_model(tmp_path, model_config={"bos_token_id": 0}))
    assert tok.bos_token_id == 0 and not tok.add_bos and not tok.has_chat_template


def test_template_variables_come_from_the_tokenizer_config_only(tmp_path: Path) -> None:
    d = write_model(
        tmp_path,
        {"eos_token": "</s>", "chat_template": "[{{ bos_token }}|{{ eos_token }}]"},
        model_config={"bos_token_id": 0},
    )
    tok = Tokenizer.from_dir(d)
    assert tok.bos_token_id == 0  # known for encoding...
    assert tok.apply_chat_template([]) == "[|</s>]"  # ...but not a template variable


def test_missing_tokenizer_json_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json: file not found"):
        Tokenizer.from_dir(tmp_path)


def test_missing_directory_is_a_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not a directory"):
        Tokenizer.from_dir(tmp_path / "nope")


def test_broken_json_names_the_file_and_the_line(tmp_path: Path) -> None:
    d = write_model(tmp_path, BASE)
    (d / "tokenizer_config.json").write_text('{\n  "bos_token": "<s>",\n  oops\n}')
    with pytest.raises(ModelLoadError, match=r"tokenizer_config\.json: broken JSON at line 3"):
        Tokenizer.from_dir(d)


def test_tokenizer_json_the_library_rejects_is_a_load_error(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "NoSuchModel"}}')
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json: not a tokenizer"):
        Tokenizer.from_dir(tmp_path)


def test_a_special_token_outside_the_vocabulary_names_the_field(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"field 'eos_token' is '<\|nope\|>'"):
        Tokenizer.from_dir(write_model(tmp_path, {**BASE, "eos_token": "<|nope|>"}))


def test_an_eos_id_of_the_wrong_type_names_the_file_and_field(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"config\.json: field 'eos_token_id'"):
        Tokenizer.from_dir(write_model(tmp_path, BASE, model_config={"eos_token_id": "2"}))


def test_add_bos_token_must_be_a_boolean(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="add_bos_token"):
        Tokenizer.from_dir(write_model(tmp_path, {**BASE, "add_bos_token": "yes"}))


# -- chat templates ----------------------------------------------------------------------


def chat_model(tmp_path: Path, template: object = TEMPLATE) -> Tokenizer:
    return Tokenizer.from_dir(write_model(tmp_path, {**BASE, "chat_template": template}))


def test_chat_template_renders_messages_with_the_generation_prompt(tmp_path: Path) -> None:
    tok = chat_model(tmp_path)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 😀"}]
    assert tok.apply_chat_template(msgs) == (
        "<s><|system|>\nBe brief.</s>\n<|user|>\nHi 😀</s>\n<|assistant|>\n"
    )
    assert not tok.apply_chat_template(msgs, add_generation_prompt=False).endswith("assistant|>\n")


THINKING = (
    "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    "{% if enable_thinking is defined and not enable_thinking %} /no_think{% endif %}"
)


def test_a_requests_template_variables_reach_the_template(tmp_path: Path) -> None:
    tok = chat_model(tmp_path, THINKING)
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == "hi"
    assert tok.apply_chat_template(msgs, template_kwargs={"enable_thinking": False}) == (
        "hi /no_think"
    )
    with_kwargs = tok.encode_chat(msgs, template_kwargs={"enable_thinking": False})
    assert with_kwargs == tok.encode("hi /no_think", add_special_tokens=True)


def test_a_template_variable_the_server_sets_is_refused_naming_the_field(
    tmp_path: Path,
) -> None:
    tok = chat_model(tmp_path, THINKING)
    with pytest.raises(FieldError, match=r"'chat_template_kwargs\.messages'") as caught:
        tok.apply_chat_template(
            [{"role": "user", "content": "hi"}], template_kwargs={"messages": []}
        )
    assert caught.value.field == "chat_template_kwargs"


def test_encode_chat_has_exactly_one_bos(tmp_path: Path) -> None:
    tok = chat_model(tmp_path)
    ids = tok.encode_chat([{"role": "user", "content": "the cat"}])
    assert ids[0] == 0 and ids.count(0) == 1
    assert tok.decode(ids, skip_special_tokens=False).startswith("<s><|user|>")


def test_the_default_named_template_is_chosen_from_a_list(tmp_path: Path) -> None:
    templates = [
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": "{{ messages[0]['content'] }}!"},
    ]
    tok = chat_model(tmp_path, templates)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "x!"


def test_chat_template_jinja_file_wins_over_the_config(tmp_path: Path) -> None:
    d = write_model(tmp_path, {**BASE, "chat_template": "CONFIG"})
    (d / "chat_template.jinja").write_text("FILE {{ messages|length }}")
    assert Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "x"}]) == "FILE 1"


def test_a_model_without_a_template_refuses_chat_with_a_user_error(tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(write_model(tmp_path, BASE))
    with pytest.raises(UserError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_a_template_without_default_names_the_ones_it_has(tmp_path: Path) -> None:
    tok = chat_model(tmp_path, [{"name": "rag", "template": "R"}])
    with pytest.raises(UserError, match="named templates: rag"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_raise_exception_in_a_template_is_a_user_error(tmp_path: Path) -> None:
    tok = chat_model(tmp_path)
    msgs = [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]
    with pytest.raises(UserError, match="the system message must come first"):
        tok.apply_chat_template(msgs)


def test_a_template_cannot_reach_python_internals(tmp_path: Path) -> None:
    # The classic escape: from any object to object.__subclasses__() and on to os.system.
    tok = chat_model(tmp_path, "{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError, match="unsafe"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_a_template_cannot_mutate_the_callers_messages(tmp_path: Path) -> None:
    tok = chat_model(tmp_path, "{{ messages.append(1) }}")
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template(msgs)
    assert msgs == [{"role": "user", "content": "hi"}]


def test_tojson_does_not_html_escape(tmp_path: Path) -> None:
    tok = chat_model(
        tmp_path, "{{ messages[0] | tojson }}|{{ {'b': 1, 'a': '<&>'} | tojson(sort_keys=True) }}"
    )
    out = tok.apply_chat_template([{"role": "user", "content": "a<b>&ü"}])
    assert out == '{"role": "user", "content": "a<b>&ü"}|{"a": "<&>", "b": 1}'


def test_strftime_now_and_loop_controls_are_available(tmp_path: Path) -> None:
    tok = chat_model(
        tmp_path,
        "{{ strftime_now('%Y') | length }}{% for m in messages %}{% if loop.index > 1 %}"
        "{% break %}{% endif %}{{ m['content'] }}{% endfor %}",
    )
    out = tok.apply_chat_template(
        [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    )
    assert out == "4a"


def test_generation_tags_render_their_body(tmp_path: Path) -> None:
    tok = chat_model(tmp_path, "{% generation %}{{ messages[0]['content'] }}{% endgeneration %}")
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "x"


def test_a_template_that_does_not_compile_is_a_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="chat template 'default' does not compile"):
        chat_model(tmp_path, "{% for m in messages %}")


def test_chat_rendering_and_ids_match_transformers(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    d = write_model(tmp_path, {**BASE, "chat_template": TEMPLATE})
    ref = transformers.AutoTokenizer.from_pretrained(str(d))
    tok = Tokenizer.from_dir(d)
    msgs = [{"role": "system", "content": "Sé breve."}, {"role": "user", "content": "Hi 😀 中文"}]
    text = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(msgs) == text
    ref_ids = ref.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    ref_ids = ref_ids["input_ids"] if not isinstance(ref_ids, list) else ref_ids
    assert tok.encode_chat(msgs) == list(ref_ids)
    for sample in ["Hello world", " the  cat\n", "😀😀 中文 fox."]:
        assert tok.encode(sample, add_special_tokens=False) == ref.encode(
            sample, add_special_tokens=False
        )
        ids = tok.encode(sample, add_special_tokens=False)
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
