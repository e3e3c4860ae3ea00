"""The [business] config section and the system prompt built from it (pipeline/receptionist/business.py)."""

import json
import re
import tomllib
from pathlib import Path

import pytest

from bench import DIALOGUES
from demo import BUSINESSES
from pipeline.receptionist.business import BusinessConfig, day_hours, default_business, facts_prompt
from pipeline.config import Config, ConfigError, load_config


MINIMAL = '[business]\nname = "Luigi\'s Bistro"\nrole = "host"\ngreeting = "Luigi\'s, good evening!"\n'


def business(path: Path) -> BusinessConfig:
    return BusinessConfig.model_validate(tomllib.loads(path.read_text())["business"])


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "agent.toml"
    path.write_text(text)
    return path


# ---------------------------------------------------------------- config errors


@pytest.mark.parametrize("field", ["name", "role", "greeting"])
def test_a_missing_required_field_is_an_error_naming_it(tmp_path, field):
    text = "\n".join(line for line in MINIMAL.splitlines() if not line.startswith(field)) + "\n"
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text))
    assert f"business.{field}" in str(err.value) and "Field required" in str(err.value)


@pytest.mark.parametrize("line, field", [
    ('name = "  "', "business.name"),
    ('greeting = ""', "business.greeting"),
])
def test_an_empty_required_field_is_an_error_naming_it(tmp_path, line, field):
    key = line.split(" = ")[0]
    text = "\n".join(ln for ln in MINIMAL.splitlines() if not ln.startswith(key)) + "\n" + line + "\n"
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text))
    assert f"{field} is empty; it is required" in str(err.value)


@pytest.mark.parametrize("extra, field", [
    ('address = ""', "business.address"),
    ("open_slots = []", "business.open_slots"),
    ("facts = []", "business.facts"),
    ("[business.hours]", "business.hours"),
    ("[business.prices]", "business.prices"),
])
def test_an_empty_optional_field_is_an_error_naming_it(tmp_path, extra, field):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, MINIMAL + extra + "\n"))
    assert f"{field} is empty" in str(err.value) and "leave the key out" in str(err.value)


def test_an_empty_entry_in_a_list_or_table_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"business.open_slots\[1\] is empty"):
        load_config(write(tmp_path, MINIMAL + 'open_slots = ["Tuesday 6 p.m.", " "]\n'))
    with pytest.raises(ConfigError, match=r"business.prices\['risotto'\] is empty"):
        load_config(write(tmp_path, MINIMAL + '[business.prices]\nrisotto = ""\n'))


def test_an_unknown_business_key_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="business.opening_hours"):
        load_config(write(tmp_path, MINIMAL + 'opening_hours = "9 to 5"\n'))


def test_a_minimal_business_builds_a_prompt_and_greeting(tmp_path):
    cfg = load_config(write(tmp_path, MINIMAL))
    assert cfg.agent.greeting == "Luigi's, good evening!" and cfg.agent.name == "Luigi's Bistro"
    assert "You are the host of Luigi's Bistro" in cfg.agent.system_prompt


# ---------------------------------------------------------------- old configs, overrides


def test_an_explicit_system_prompt_still_overrides_when_there_is_no_business_section(tmp_path):
    cfg = load_config(write(tmp_path, '[agent]\nsystem_prompt = "You are a pirate."\ngreeting = "Ahoy"\n'))
    assert cfg.agent.system_prompt == "You are a pirate." and cfg.agent.greeting == "Ahoy"


def test_a_prompt_and_a_business_together_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="both agent.system_prompt and a \\[business\\] section"):
        load_config(write(tmp_path, '[agent]\nsystem_prompt = "You are a pirate."\n' + MINIMAL))


def test_a_config_survives_a_dump_and_reload():
    cfg = load_config()
    again = Config.model_validate(json.loads(json.dumps(cfg.model_dump(mode="json"))))
    assert again.agent.system_prompt == cfg.agent.system_prompt and again.business == cfg.business


def test_prompt_options_change_the_built_prompt(tmp_path):
    hours = '[business.hours]\n"Tuesday to Sunday" = "5 p.m. to 10 p.m."\nMonday = "closed"\n'
    lines = load_config(write(tmp_path, MINIMAL + hours))
    para = load_config(write(tmp_path, '[agent]\nprompt_layout = "paragraph"\nprompt_rules = false\n' + MINIMAL + hours))
    checker = load_config(write(tmp_path, '[agent]\nprompt_persona = "checker"\nprompt_examples = true\n' + MINIMAL + hours))
    assert "- Opening hours: Tuesday to Sunday 5 p.m. to 10 p.m.; Monday closed." in lines.agent.system_prompt
    assert "Rules:" in lines.agent.system_prompt and "Examples:" not in lines.agent.system_prompt
    assert "Hours: Tuesday to Sunday 5 p.m. to 10 p.m., Monday closed." in para.agent.system_prompt
    assert "Rules:" not in para.agent.system_prompt
    assert checker.agent.system_prompt.startswith("You are a fact checker answering phone calls for Luigi's Bistro.")
    assert "Examples:" in checker.agent.system_prompt


def test_a_bad_prompt_option_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="agent.prompt_layout"):
        load_config(write(tmp_path, '[agent]\nprompt_layout = "table"\n'))


# ---------------------------------------------------------------- the default business


def test_default_config_default_business_and_dental_file_agree():
    """One Riverside Dental: configs/default.toml, the built-in default and the bench's file."""
    dental = business(BUSINESSES / "dental.toml")
    assert load_config().business == default_business() == dental
    assert Config().business == dental  # a config without [business] (gpu.toml, test.toml)
    for name in ("gpu", "test"):
        assert load_config(name).agent.system_prompt == load_config().agent.system_prompt


def numbers(text: str) -> set[str]:
    return set(re.findall(r"\d+(?:[:.]\d+)?", text))


@pytest.mark.parametrize("key", ["dental", "bistro", "isp", "shop"])
def test_each_demo_business_states_every_figure_of_its_dialogues_prompt(key):
    """The business files hold the same facts as the benchmark dialogues' prompts: every
    number there (prices, times, order numbers) is in the prompt built from the file."""
    turns = json.loads(DIALOGUES.read_text())["turns"]
    old = next(t["messages"][0]["content"] for t in turns if t["id"].startswith(key + "-"))
    built = facts_prompt(business(BUSINESSES / f"{key}.toml"))
    assert numbers(old) <= numbers(built), numbers(old) - numbers(built)


# ---------------------------------------------------------------- the prompt builder


def test_hours_ranges_expand_to_one_line_per_day_and_unlisted_days_are_closed():
    assert day_hours({"Monday to Friday": "8-6", "Saturday": "9-1"}) == [
        ("Monday", "8-6"), ("Tuesday", "8-6"), ("Wednesday", "8-6"), ("Thursday", "8-6"), ("Friday", "8-6"),
        ("Saturday", "9-1"), ("Sunday", "closed")]
    assert day_hours({"Tue-Sun": "5-10"})[0] == ("Monday", "closed")
    assert day_hours({"Saturday and Sunday": "10-4"})[5:] == [("Saturday", "10-4"), ("Sunday", "10-4")]
    assert day_hours({"weekdays": "9-5"})[4:] == [("Friday", "9-5"), ("Saturday", "closed"), ("Sunday", "closed")]
    assert day_hours({"Phone support": "24 hours a day"}) is None  # not days: kept as written


def test_lines_layout_has_one_labelled_fact_a_line():
    p = facts_prompt(default_business(), layout="lines", rules=False, examples=False)
    for line in ("- Address: 42 Harbor Street, Springfield, next to the public library.", "- Phone: 555-0142.",
                 "- Opening hours: Monday to Friday 8 a.m. to 6 p.m.; Saturday 9 a.m. to 1 p.m.; Sunday closed.",
                 "- Price of cleaning: $89.", "- Price of filling: from $120.",
                 "- Open slot: Wednesday 2:15 p.m. with Dr. Moreno.", "- Parking is free behind the building."):
        assert line in p.splitlines(), line
    assert "Rules:" not in p and "Examples:" not in p


def test_rules_say_a_fixed_fallback_sentence_which_the_business_may_change():
    b = default_business()
    p = facts_prompt(b, rules=True)
    assert ('- If the facts do not answer the question, say: "I\'m not sure about that. I can take a message and '
            'have someone call you back."') in p
    assert "- Never agree with something the facts do not say." in p
    own = b.model_copy(update={"fallback": "Let me ask the dentist and call you back."})
    assert 'say: "Let me ask the dentist and call you back."' in facts_prompt(own, rules=True)


def test_examples_quote_only_the_businesss_own_facts():
    p = facts_prompt(default_business(), rules=False, examples=True)
    assert 'Caller: "How much is filling?"\nYou: "Filling is from $120."' in p
    assert 'Caller: "Cleaning is $178, right?"\nYou: "Actually, cleaning is $89."' in p
    assert 'Caller: "Can I come by on Sunday?"\nYou: "Sorry, we\'re closed on Sunday."' in p
    # A business with no closed day gets no closed-day example.
    isp = business(BUSINESSES / "isp.toml")
    assert "closed" not in facts_prompt(isp, rules=False, examples=True)


def test_business_examples_from_the_config_are_added():
    b = BusinessConfig(name="Luigi's", role="host", greeting="Hi", examples=[{"caller": "Valet?", "agent": "Let me check."}])
    assert 'Caller: "Valet?"\nYou: "Let me check."' in facts_prompt(b, examples=True)
    assert "Valet" not in facts_prompt(b, examples=False)


def test_paragraph_layout_is_the_old_single_paragraph():
    p = facts_prompt(default_business(), layout="paragraph", rules=False, examples=False)
    facts = p.split("\n\n")[1]
    assert facts.startswith("Facts: address 42 Harbor Street") and "\n" not in facts
    assert "Hours: Monday to Friday 8 a.m. to 6 p.m., Saturday 9 a.m. to 1 p.m., Sunday closed." in facts


# ---------------------------------------------------------------- base = "default": your own business


def test_a_business_file_with_base_default_is_the_default_config_for_that_business():
    bistro = load_config(BUSINESSES / "bistro.toml")
    default = load_config()
    assert bistro.business == business(BUSINESSES / "bistro.toml")
    assert "Luigi's Bistro" in bistro.agent.system_prompt and "Riverside" not in bistro.agent.system_prompt
    assert bistro.agent.greeting.startswith("Luigi's Bistro")
    # Everything else is the default config's (models, STT, agent options), not pydantic's defaults.
    for section in ("llm", "stt", "tts", "vad", "turn", "bridge", "tools"):
        assert getattr(bistro, section) == getattr(default, section), section
    assert bistro.agent.prompt_rules == default.agent.prompt_rules
    # The dental file is the default config exactly.
    assert load_config(BUSINESSES / "dental.toml") == default


def test_a_section_overrides_only_its_own_keys_and_business_replaces_whole(tmp_path):
    default = load_config()
    path = write(tmp_path, 'base = "default"\n[stt]\nbeam_size = 3\n' + MINIMAL)
    config = load_config(path)
    assert config.stt.beam_size == 3
    assert config.stt.model == default.stt.model  # the rest of [stt] is the base's
    # The base's dental hours, prices and slots must not leak into Luigi's.
    assert config.business.hours is None or config.business.hours != default.business.hours
    assert not config.business.prices and not config.business.open_slots
    assert "$89" not in config.agent.system_prompt and "Dr. Patel" not in config.agent.system_prompt


def test_base_may_be_a_file_beside_the_config(tmp_path):
    (tmp_path / "shared.toml").write_text('base = "default"\n[llm]\nmax_new_tokens = 77\n')
    path = tmp_path / "mine.toml"
    path.write_text('base = "shared.toml"\n' + MINIMAL)
    config = load_config(path)
    assert config.llm.max_new_tokens == 77 and config.business.name == "Luigi's Bistro"
    assert config.stt.model == load_config().stt.model


@pytest.mark.parametrize("base, message", [
    ('"nonexistent"', "config file not found"),
    ("3", "base must be a config name or a path"),
    ('"agent.toml"', "leads back to itself"),
])
def test_a_bad_base_is_a_clear_error(tmp_path, base, message):
    path = write(tmp_path, f"base = {base}\n" + MINIMAL)
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_a_base_cycle_is_an_error(tmp_path):
    (tmp_path / "a.toml").write_text('base = "b.toml"\n')
    (tmp_path / "b.toml").write_text('base = "a.toml"\n')
    with pytest.raises(ConfigError, match="leads back to itself"):
        load_config(tmp_path / "a.toml")
