import pytest
import yaml

from lm.config import JobConfig, load_config, parse_cli, read_stored_config, save_config
from lm.config.command_line import unread_override
from lm.config.rules import MAX_SEED
from lm.errors import ConfigError, LMError
from lm.models.registry import config_class, family_names


def test_defaults_then_yaml_then_overrides(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("model:\n  n_layer: 3\n  d_model: 64\n  n_head: 4\ntrain:\n  steps: 10\n")
    cfg = load_config(path, ["--model.n_layer=5", "--optim.lr=1e-3", "--log.tensorboard=false"])
    assert cfg.model.n_layer == 5  # the command line wins over the file
    assert cfg.model.d_model == 64 and cfg.train.steps == 10  # the file wins over defaults
    assert cfg.optim.lr == 1e-3 and isinstance(cfg.optim.lr, float)
    assert cfg.log.tensorboard is False
    assert cfg.data.tokenizer == "gpt2"  # untouched default


def test_int_accepted_for_float():
    assert load_config(None, ["--optim.lr=1"]).optim.lr == 1.0


def test_text_that_reads_as_a_yaml_mapping_is_taken_literally():
    assert load_config(None, ["--log.sample_prompt=KING: hi"]).log.sample_prompt == "KING: hi"
    assert load_config(None, ["--log.sample_prompt=[a, b]"]).log.sample_prompt == "[a, b]"


def test_a_text_key_given_a_number_keeps_it_as_written(tmp_path):
    # YAML 1.1 reads 2024_12_01 as 20241201 and 010 as 8; a text key takes the characters given
    cfg = load_config(None, ["--train.out_dir=2024_12_01", "--data.dir=010", "--train.steps=1_000"])
    assert (cfg.train.out_dir, cfg.data.dir) == ("2024_12_01", "010")
    assert cfg.train.steps == 1000 and type(cfg.train.steps) is int  # a number key still reads the number
    path = tmp_path / "job.yaml"
    path.write_text("train:\n  out_dir: 2024_12_01\ndata:\n  dir: 1.50\n")
    cfg = load_config(path)
    assert (cfg.train.out_dir, cfg.data.dir) == ("2024_12_01", "1.50")
    save_config(cfg, tmp_path / "saved.yaml")
    assert load_config(tmp_path / "saved.yaml") == cfg


def test_a_text_key_on_the_command_line_keeps_what_was_written_unless_quoted(tmp_path):
    # YAML would cut ` #...` as a comment, strip the spaces a BPE prompt starts with and read a date
    cfg = load_config(None, ["--log.sample_prompt= ROMEO #1: hi", "--train.out_dir=2024-12-01",
                             "--data.document_separator='<|doc|>'"])
    assert (cfg.log.sample_prompt, cfg.train.out_dir) == (" ROMEO #1: hi", "2024-12-01")
    assert cfg.data.document_separator == "<|doc|>"  # in quotes: YAML's, as for escapes in double quotes
    path = tmp_path / "job.yaml"
    path.write_text("train:\n  out_dir: 2024-12-01\n")  # no key is a date: YAML's timestamp stays text
    assert load_config(path).train.out_dir == "2024-12-01"


@pytest.mark.parametrize("written, read, base", [("010", 8, "octal"), ("1:30", 90, "base 60"), ("-07", -7, "octal")])
def test_a_number_yaml_reads_in_octal_or_base_60_is_refused(written, read, base, tmp_path):
    message = rf"^train.steps: YAML reads '{written}' as {read} \({base}\); write the number in decimal"
    with pytest.raises(ConfigError, match=message):
        load_config(None, [f"--train.steps={written}"])
    path = tmp_path / "job.yaml"
    path.write_text(f"train:\n  steps: {written}\n")
    with pytest.raises(ConfigError, match=message):
        load_config(path)
    with pytest.raises(ConfigError, match=r"^optim.lr: YAML reads '1:2' as 62 \(base 60\)"):
        load_config(None, ["--optim.lr=1:2"])
    assert load_config(None, ["--train.steps=0x10", "--optim.lr=0.010"]).train.steps == 16  # meant as written


def test_a_number_too_large_is_named_not_an_overflow(tmp_path):
    with pytest.raises(ConfigError, match=r"^optim.weight_decay: must be a finite number, got 100000000000\.\.\. "
                                          r"\(401 digits\)$"):
        load_config(None, ["--optim.weight_decay=1" + "0" * 400])
    with pytest.raises(ConfigError, match=r"^--train.steps: a number YAML cannot read: Exceeds the limit"):
        load_config(None, ["--train.steps=1" + "0" * 5000])
    path = tmp_path / "job.yaml"
    path.write_text("train:\n  steps: 1" + "0" * 5000 + "\n")
    with pytest.raises(ConfigError, match=rf"^{path}: a number YAML cannot read: Exceeds the limit"):
        load_config(path)


def test_yaml_merge_keys_share_a_block_and_the_keys_given_win(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("train: &shared\n  steps: 7\n  seed: 3\nschedule:\n  warmup_steps: 2\n"
                    "optim:\n  <<: {lr: 0.5, eps: 1.0e-6}\n  lr: 0.25\n")
    cfg = load_config(path)
    assert (cfg.optim.lr, cfg.optim.eps, cfg.train.steps) == (0.25, 1e-6, 7)
    path.write_text("optim:\n  lr: 0.5\n  lr: 0.25\n")  # a key given twice by hand is still refused
    with pytest.raises(ConfigError, match="key 'lr' is given twice"):
        load_config(path)


def test_a_number_as_a_key_is_named(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("train:\n  1: 2\n")  # was TypeError: 'int' object is not iterable
    with pytest.raises(ConfigError, match="^train.1: unknown key; expected one of"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"^--data.mixture: key 'dir' is given twice$"):
        load_config(None, ["--data.mixture=[{dir: a, dir: b}]"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("--model.n_layr=2", "model.n_layr: not a key of a decoder-only GPT"),
        ("--modle.n_layer=2", "modle: unknown key"),
        ("--model.n_layer=two", "model.n_layer: expected int, got str"),
        ("--model.n_layer=2.5", "model.n_layer: expected int, got float"),
        ("--log.tensorboard=1", "log.tensorboard: expected bool, got int"),
        ("--model.dropout=true", "model.dropout: expected float, got bool"),
        ("--model.n_head=5", "model.d_model: 768 is not divisible by model.n_head=5"),
        ("--model.n_layer=0", "model.n_layer: must be positive"),
        ("--data.seq_len=2048", "data.seq_len: 2048 exceeds model.block_size=1024"),
        ("--data.tokenizer=bpe", "data.tokenizer: unknown tokenizer 'bpe'"),
        ("--model.vocab_size=50304", "model.vocab_size: 50304 does not match tokenizer 'gpt2'"),
        ("--train.micro_batch_size=5", "train.batch_size: 32 is not a multiple of train.micro_batch_size=5"),
        ("--train.device=tpu", "train.device: expected auto, cpu or cuda"),
        ("--checkpoint.resume=maybe", "checkpoint.resume: expected auto, never or required"),
        ("--optim.beta2=1.5", "optim.beta2: must be in [0, 1)"),
        ("--schedule.decay_steps=50", "schedule.decay_steps: 50 ends the decay before warmup ends "
         "(schedule.warmup_steps=100); expected at least 100, or 0 for train.steps"),
        ("--data.document_separator=\\n\\n", "data.document_separator: '\\\\n\\\\n' holds a backslash escape"),
        ("--schedule.warmup_steps=-3", "schedule.warmup_steps: must be >= 0, got -3"),
        ("--schedule.decay_steps=-5", "schedule.decay_steps: must be >= 0, got -5"),
        ("--log.sample_every=-1", "log.sample_every: must be >= 0"),
        ("--checkpoint.every=-1", "checkpoint.every: must be >= 0"),
        ("--checkpoint.keep=0", "checkpoint.keep: must be positive"),
        ("--log.sample_tokens=0", "log.sample_tokens: must be positive"),
        ("--model.n_layer=a: b", "model.n_layer: expected int, got str 'a: b'"),
        ("--model=3", "model: overrides take the form"),
        ("--train.float8=on", "train.float8: expected off, tensorwise or rowwise, got 'on'"),
        ("--train.float8=fp8", "train.float8: expected off, tensorwise or rowwise, got 'fp8'"),
        ("--train.float8=tensorwise --parallel.engine=fsdp --parallel.tp=2",
         "train.float8=tensorwise: not yet under parallel.tp=2"),
        ("--train.float8=rowwise --parallel.engine=fsdp --parallel.cpu_offload=true",
         "train.float8=rowwise: float8 speeds up GPU matmuls, and an offloaded run waits on host copies"),
        ("--model.n_layer", "overrides take the form --section.key=value"),
        ("--train.out_dir=", "train.out_dir: empty; name the run directory"),  # not the working directory
        ("--train.seed=-1", "train.seed: expected 0 to 9223372036854775807 (a 63-bit seed), got -1"),
        ("--train.steps=100000000000000000000", "train.steps: 100000000000000000000 does not fit a 64-bit integer"),
        ("--model.arch=lstm --data.mlm_rate=0.5", "data.mlm_rate: sets the masked LM of an encoder, and an LSTM "
         "(model.arch=lstm) trains no masked LM; drop it"),
        ("--train.seed=18446744073709551616", "train.seed: 18446744073709551616 does not fit a 64-bit integer"),
        ("--model.n_layer=true", "model.n_layer: expected int, got bool"),  # True would be 1 layer
        ("--data.seq_len=1025", "data.seq_len: 1025 exceeds model.block_size=1024"),  # one past the positions
        ("--task.file=x.csv", "task.file: only a fine-tuning head"),
        ("--model.arch=encoder --model.head=classify --model.num_classes=2",
         "task.file: model.head=classify trains on a labelled file"),
    ],
)
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, override.split(" --"))
    assert message in str(err.value)


def test_a_config_file_that_is_not_utf8_is_one_error_naming_it(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(LMError, match=f"^{path}: .*UTF-8"):
        load_config(path)
    with pytest.raises(LMError, match=f"^{path}: .*UTF-8"):  # a checkpoint's stored config.yaml, read the same way
        read_stored_config(path)


def test_float8_off_reads_as_yaml_writes_it(tmp_path):
    # YAML 1.1 reads a bare `off` as False; train.float8, whose default is "off", takes it back as the word
    path = tmp_path / "job.yaml"
    path.write_text("train:\n  float8: off\n")
    assert load_config(path).train.float8 == "off"
    cfg = load_config(None, ["--train.float8=rowwise"])
    assert cfg.train.float8 == "rowwise" and load_config(None, ["--train.float8=off"]).train.float8 == "off"
    save_config(load_config(path), tmp_path / "saved.yaml")
    assert load_config(tmp_path / "saved.yaml").train.float8 == "off"


def test_bad_yaml_files(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML") as err:
        load_config(bad)
    # one line, as every error is: PyYAML's message quotes the text over five
    assert str(err.value) == (f"{bad}: not valid YAML: expected ',' or ']', but got '<stream end>' (while parsing "
                              "a flow sequence) at line 2, column 1")
    for text, kind in (("[a]: 1\n", "list"), ("data:\n  {a: 1}: 2\n", "dict")):  # were TypeErrors
        bad.write_text(text)
        with pytest.raises(ConfigError, match=rf"^{bad}: not valid YAML: a {kind} as a key at line \d+, column \d+$"):
            load_config(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("model: 3\n")
    with pytest.raises(ConfigError, match="model: expected a mapping"):
        load_config(scalar)


def test_save_round_trip(tmp_path):
    cfg = load_config(None, ["--model.n_layer=2", "--data.source=a.txt,b.txt", '--data.document_separator="\\n\\n"'])
    assert cfg.data.document_separator == "\n\n"  # YAML reads escapes in double quotes
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["model"]["n_layer"] == 2


def test_cli_lists_every_key_in_help(capsys):
    with pytest.raises(SystemExit):
        parse_cli(["--help"], "test tool")
    out = capsys.readouterr().out
    for section in JobConfig.__dataclass_fields__:
        assert f"--{section}." in out
    assert "--train.micro_batch_size=8 (int) Sequences per rank per forward/backward" in out
    assert "--data.mixture=[] (list) Train on several prepared directories" in out  # a default_factory's value


def test_cli_rejects_stray_arguments():
    with pytest.raises(SystemExit):
        parse_cli(["steps=3"], "test tool")


def test_cli_refuses_a_second_config_file(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_cli(["--config", "configs/demo.yaml", "--config=configs/gpt2-124m.yaml"], "test tool")
    assert exit_.value.code == 2
    assert "--config is given twice (configs/demo.yaml, configs/gpt2-124m.yaml)" in capsys.readouterr().err
    assert parse_cli(["--config", "configs/demo.yaml"], "test tool")[1].config == "configs/demo.yaml"


@pytest.mark.parametrize("tool, args, message", [
    ("lm.prepare", ["--train.steps=3"], "--train.steps: this tool does not read it (it reads data, "
     "model.vocab_size), so it would change nothing"),
    ("lm.train_tokenizer", ["--out", "t.json", "--vocab-size", "300", "--model.n_layer=3"],
     "--model.n_layer: this tool does not read it (it reads data.source, data.text_column, data.document_separator, "
     "data.val_fraction)"),
    ("lm.train_tokenizer", ["--out", "t.json", "--vocab-size", "300", "--model.vocab_size=300"],  # its own tokenizer's
     "--model.vocab_size: this tool does not read it"),  # was refused as not matching GPT-2's 50257
    ("lm.train_tokenizer", ["--out", "t.json", "--vocab-size", "300", "--data.tokenizer=cl100k_base"],
     "--data.tokenizer: this tool does not read it"),
    ("lm.finetune", ["--encoder", "run", "--data.val_fraction=0.5"], "--data.val_fraction: this tool does not read "
     "it (it reads model, optim, schedule, train, parallel, checkpoint, log, task, data.seq_len), so it would change "
     "nothing; did you mean --task.val_fraction?"),
])
def test_a_tool_refuses_an_override_it_would_not_read(tool, args, message, capsys, monkeypatch):
    import importlib

    module = importlib.import_module(tool)
    if tool == "lm.finetune":  # no encoder is read before the overrides are parsed
        monkeypatch.setattr(module, "encoder_config", lambda path: load_config(None, ["--model.arch=encoder"]))
        monkeypatch.setattr(module, "encoder_base", lambda path, saved: None)
    with pytest.raises(SystemExit) as exit_:
        module.main(["--config", "configs/demo.yaml", *args])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_prepare_takes_the_vocab_size_a_tiktoken_tokenizer_needs_and_jobs_pass_it_on(tmp_path):
    from lm.cli import PREPARE_READS, prepare_command

    args = ["--data.tokenizer=cl100k_base", "--model.vocab_size=100277", f"--data.dir={tmp_path}/d"]
    assert parse_cli(args, "t", reads=PREPARE_READS)[0].data.tokenizer == "cl100k_base"
    assert prepare_command([], [*args, "--model.n_layer=2", "--train.steps=5"])[3:] == args


def test_a_tool_takes_the_keys_it_reads_and_leaves_unknown_sections_to_the_loader():
    assert parse_cli(["--data.seq_len=64", "--task.val_fraction=0.5"], "t", reads=("task", "data.seq_len"))[0] \
        .data.seq_len == 64
    with pytest.raises(ConfigError, match="dta"):
        parse_cli(["--dta.seq_len=64"], "t", reads=("data",))


def test_an_empty_data_dir_is_named_by_its_key():
    # the check of a mixture's entries named it "dir"
    with pytest.raises(ConfigError, match=r"^data.dir: expected a non-empty string, got ''$"):
        load_config("configs/demo.yaml", ["--data.dir="])
    assert load_config("configs/demo.yaml", ["--data.dir=", "--data.mixture=[{dir: a}]"]).data.sources[0].dir == "a"


def test_presets_load():
    demo = load_config("configs/demo.yaml")
    big = load_config("configs/gpt2-124m.yaml")
    assert demo.train.device == "cpu" and demo.model.d_model == 128
    assert (big.model.n_layer, big.model.n_head, big.model.d_model, big.model.block_size) == (12, 12, 768, 1024)
    assert big.train.dtype == "bfloat16" and big.data.seq_len == 1024


def test_a_mixture_comes_from_yaml_or_a_cli_flow_list_and_round_trips(tmp_path):
    (tmp_path / "mix.yaml").write_text("data:\n  mixture:\n    - {dir: data/plays, weight: 3}\n"
                                       "    - {dir: /corpora/kjv/, weight: 1, name: bible}\n")
    cfg = load_config(tmp_path / "mix.yaml")
    assert [(s.dir, s.weight, s.name) for s in cfg.data.sources] == [("data/plays", 3.0, "plays"),
                                                                      ("/corpora/kjv/", 1.0, "bible")]
    flow = load_config(None, ["--data.mixture=[{dir: data/plays, weight: 3}, {dir: /corpora/kjv/, weight: 1, "
                              "name: bible}]"])
    assert flow.data.mixture == cfg.data.mixture
    save_config(cfg, tmp_path / "saved.yaml")
    assert load_config(tmp_path / "saved.yaml").data.mixture == cfg.data.mixture
    # without a mixture, training reads data.dir alone, as a source of weight 1
    assert [(s.dir, s.weight) for s in load_config(None, ["--data.dir=data/x"]).data.sources] == [("data/x", 1.0)]
    # a scalar key still takes YAML-looking text literally
    assert load_config(None, ["--log.sample_prompt=KING: hi"]).log.sample_prompt == "KING: hi"
    # and text YAML cannot read at all: "*" starts an alias (a traceback, for --data.source='*.jsonl')
    for text in ("*.jsonl", "a: b: c", "[a", "{x"):
        assert load_config(None, [f"--data.source={text}"]).data.source == text
    with pytest.raises(ConfigError, match=r"^--data.mixture: not valid YAML: expected ',' or '}', but got "
                                          r"'<stream end>' \(while parsing a flow mapping\) at line 1, column 9$"):
        load_config(None, ["--data.mixture=[{dir: a"])


def test_an_override_that_switches_the_family_keeps_the_file_keys_the_family_takes(tmp_path):
    # demo.yaml describes a GPT: the LSTM takes its width and depth, not its heads or positions
    lstm = load_config("configs/demo.yaml", ["--model.arch=lstm"]).model
    assert (lstm.arch, lstm.n_layer, lstm.d_model, lstm.block_size) == ("lstm", 4, 128, 256)
    # a key given with the switch is the user's own, and must be the new family's
    with pytest.raises(ConfigError, match=r"model.n_head: not a key of an LSTM \(model.arch=lstm\)"):
        load_config("configs/demo.yaml", ["--model.arch=lstm", "--model.n_head=4"])
    # a file that names the family itself is checked whole: an LSTM file holding a head count is a mistake
    path = tmp_path / "lstm.yaml"
    path.write_text("model:\n  arch: lstm\n  n_head: 4\n")
    with pytest.raises(ConfigError, match=r"model.n_head: not a key of an LSTM"):
        load_config(path)


def test_a_key_that_is_a_python_keyword_is_read_and_written_as_the_keyword(tmp_path):
    cfg = load_config(None, ["--checkpoint.async=true"])
    assert cfg.checkpoint.async_ is True and cfg.to_dict()["checkpoint"]["async"] is True
    save_config(cfg, tmp_path / "config.yaml")
    assert "async: true" in (tmp_path / "config.yaml").read_text() and load_config(tmp_path / "config.yaml") == cfg
    with pytest.raises(ConfigError, match=r"checkpoint.async_: unknown key; did you mean 'async'\?"):
        load_config(None, ["--checkpoint.async_=true"])


def test_a_window_as_long_as_the_positions_loads():
    assert load_config(None, ["--data.seq_len=1024"]).data.seq_len == 1024


def test_the_yaml_file_wins_over_the_base_and_keeps_what_it_does_not_set(tmp_path):
    # lm.finetune's base is the encoder checkpoint's config: a fine-tuning YAML's keys must win over it
    path = tmp_path / "ft.yaml"
    path.write_text("train:\n  steps: 10\ndata:\n  seq_len: 64\n")
    cfg = load_config(path, [], base={"train": {"steps": 1, "batch_size": 64}, "data": {"seq_len": 32}})
    assert (cfg.train.steps, cfg.data.seq_len, cfg.train.batch_size) == (10, 64, 64)


def test_seed_bounds_are_exactly_63_bits():
    assert load_config(None, [f"--train.seed={2**63 - 1}"]).train.seed == 2**63 - 1 == MAX_SEED
    with pytest.raises(ConfigError, match="train.seed"):
        load_config(None, [f"--train.seed={2**63}"])


def test_an_int_key_holds_exactly_64_bits():
    # the largest int64 passes the loader's own check (then the key's range check names it)
    with pytest.raises(ConfigError, match="does not fit a 64-bit integer"):
        load_config(None, [f"--train.steps={2**63}"])
    assert load_config(None, [f"--train.steps={2**63 - 1}"]).train.steps == 2**63 - 1


@pytest.mark.parametrize("override", [
    "--schedule.decay_steps=100",  # decay ends exactly where warmup (100) ends
    "--schedule.min_lr_ratio=1.0",  # a constant rate after warmup
    "--checkpoint.every=0",  # never save
    "--checkpoint.keep=1",
    "--log.sample_every=0",
    "--optim.beta1=0",
    "--optim.name=muon",
])
def test_boundary_values_that_mean_something_are_accepted(override):
    load_config(None, [override])


@pytest.mark.parametrize("override, key", [
    ("--optim.z_loss=-0.1", "optim.z_loss"),
    ("--task.val_fraction=0", "task.val_fraction"),
    ("--task.text_column=  ", "task.text_column"),
    ("--checkpoint.keep=0", "checkpoint.keep"),
    ("--optim.muon_momentum=1", "optim.muon_momentum"),
])
def test_out_of_range_section_values_are_refused_by_name(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override, "--optim.name=muon"] if "muon" in override else [override])


def test_context_parallelism_does_not_combine_with_pipeline_parallelism():
    with pytest.raises(ConfigError, match="parallel.cp"):
        load_config(None, ["--parallel.engine=fsdp", "--parallel.cp=2", "--parallel.pp=2"])


def test_tensor_parallel_sequence_must_split_over_tp_ranks():
    with pytest.raises(ConfigError, match="does not split into 4 sequence slices"):
        load_config(None, ["--parallel.engine=fsdp", "--parallel.tp=4", "--data.seq_len=1022",
                           "--model.n_layer=2"])


PIPELINE = ["--parallel.engine=fsdp", "--parallel.pp=2", "--model.tie_embeddings=false"]
INTERLEAVED = ["--parallel.pp_schedule=interleaved_1f1b", "--parallel.pp_stages_per_rank=2"]


def test_pipeline_stages_count_every_rank_stages():
    cfg = load_config(None, [*PIPELINE, *INTERLEAVED, "--model.n_layer=4"])
    assert cfg.parallel.pipeline_stages == 4
    assert load_config(None, []).parallel.pipeline_stages == 1
    # 3 layers cut into 2 stages, but not into 2 ranks x 2 stages each
    assert load_config(None, [*PIPELINE, "--model.n_layer=3"]).parallel.pipeline_stages == 2
    with pytest.raises(ConfigError, match="4 pipeline stages"):
        load_config(None, [*PIPELINE, *INTERLEAVED, "--model.n_layer=3"])


def test_masked_lm_keys_are_refused_for_a_model_without_one():
    with pytest.raises(ConfigError, match="data.mlm_rate"):
        load_config(None, ["--data.mlm_rate=0.5"])


def test_a_tool_reading_a_key_takes_an_override_of_that_key():
    assert unread_override("data.seq_len", ("data.seq_len", "model")) is None
    assert unread_override("model.n_layer", ("data.seq_len", "model")) is None
    assert "does not read it" in unread_override("data.dir", ("data.seq_len", "model"))


def test_cpu_offload_is_refused_under_ddp_only():
    with pytest.raises(ConfigError, match="parallel.cpu_offload: the ddp engine"):
        load_config(None, ["--parallel.cpu_offload=true"])
    assert load_config(None, ["--parallel.engine=fsdp", "--parallel.cpu_offload=true"]).parallel.cpu_offload is True


@pytest.mark.parametrize("item", ["--steps=1.5", "-train.steps=3", "train.steps=3"])
def test_an_argument_that_is_no_dotted_override_is_refused_by_the_parser(item, capsys):
    # only --section.key=value is an override: a dot in the value or a single dash makes none
    with pytest.raises(SystemExit) as exit_:
        parse_cli([item], "test tool")
    assert exit_.value.code == 2
    assert (f"error: unrecognized argument {item!r}; config overrides look like --section.key=value"
            in capsys.readouterr().err)


@pytest.mark.parametrize("value", ["", " ", "\t"])
def test_a_blank_config_path_is_refused_by_its_flag(value, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_cli(["--config", value], "test tool")
    assert exit_.value.code == 2
    assert f"argument --config: expected a path, got {value!r}" in capsys.readouterr().err


def test_help_lists_every_familys_model_keys_and_keys_as_they_are_written(capsys):
    with pytest.raises(SystemExit):
        parse_cli(["--help"], "test tool")
    out = capsys.readouterr().out
    for name in family_names():
        assert f"model (model.arch={name}: {config_class(name).title}):" in out, name
    assert "--checkpoint.async=False (bool) " in out and "async_" not in out  # the key a user types


FOUR_LAYER_PIPELINE = ["--parallel.engine=fsdp", "--parallel.pp=2", "--model.tie_embeddings=false", "--model.n_layer=4"]
ENCODER_CLASSIFIER = ["--model.arch=encoder", "--model.head=classify", "--model.num_classes=2"]


@pytest.mark.parametrize("overrides, message", [
    (["--optim.name=muon", "--optim.muon_lr=0"], "optim.muon_lr: must be positive, got 0.0"),
    (["--optim.lr=0"], "optim.lr: must be positive, got 0.0"),
    (["--optim.beta1=1"], "optim.beta1: must be in [0, 1), got 1.0"),
    (["--optim.beta1=-0.1"], "optim.beta1: must be in [0, 1), got -0.1"),
    (["--optim.weight_decay=-0.1"], "optim.weight_decay: must be >= 0, got -0.1"),
    (["--schedule.min_lr_ratio=-0.1"], "schedule.min_lr_ratio: must be in [0, 1], got -0.1"),
    (["--train.max_nonfinite_steps=0"], "train.max_nonfinite_steps: must be positive, got 0"),
    (["--train.dtype=float16"], "train.dtype: expected auto, bfloat16 or float32, got 'float16'"),
    (["--log.every=0"], "log.every: must be positive, got 0"),
    (["--task.file=rows.txt"], "task.file: 'rows.txt' must end in one of ['.csv', '.json', '.jsonl', '.parquet']"),
    (["--task.val_fraction=1"], "task.val_fraction: must be in (0, 1), got 1.0"),
    (["--parallel.engine=fsdp", "--parallel.ep=0"], "parallel.ep: must be >= 1 (1 = no expert parallelism), got 0"),
    (["--parallel.engine=fsdp", "--model.n_experts=4", "--parallel.ep=2", "--parallel.cp=2"],
     "parallel.ep=2: expert parallelism does not combine with parallel.pp or parallel.cp yet"),
    ([*FOUR_LAYER_PIPELINE, "--parallel.pp_schedule=interleaved_zero_bubble"],
     "parallel.pp_schedule: interleaved_zero_bubble is refused: with FSDP2 torch's zero-bubble schedules"),
    ([*FOUR_LAYER_PIPELINE, "--parallel.pp_stages_per_rank=2"],
     "parallel.pp_stages_per_rank: 1f1b runs one stage per rank, got 2"),
    ([*FOUR_LAYER_PIPELINE, "--parallel.pp_schedule=gpipe", "--parallel.pp_stages_per_rank=3"],
     "parallel.pp_stages_per_rank: gpipe runs one stage per rank, got 3"),
    ([*FOUR_LAYER_PIPELINE, "--checkpoint.init_from=weights.safetensors"],
     "checkpoint.init_from: a pipeline-parallel run cannot start from a consolidated or Hugging Face checkpoint"),
    (["--train.float8=tensorwise", *FOUR_LAYER_PIPELINE], "train.float8=tensorwise: not yet under parallel.pp=2"),
    (["--parallel.engine=fsdp", "--parallel.cp=2", "--data.seq_len=1022"],
     "parallel.cp=2: data.seq_len=1022 does not split into 4 equal slices (2 per context-parallel rank)"),
    (["--train.eval_tasks=hellaswag", "--parallel.engine=fsdp", "--parallel.cp=2"],
     "train.eval_tasks: scored by whole-sequence forwards on each data-parallel rank, not yet under parallel.cp=2"),
])
def test_a_section_value_or_combination_out_of_range_is_refused_with_its_message(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert message in str(err.value)


def test_a_schedule_without_a_pipeline_counts_one_stage():
    cfg = load_config(None, ["--parallel.pp_schedule=interleaved_1f1b", "--parallel.pp_stages_per_rank=2"])
    assert cfg.parallel.pp == 1 and cfg.parallel.pipeline_stages == 1


def test_the_pipeline_schedule_defaults_to_1f1b():
    assert load_config(None, []).parallel.pp_schedule == "1f1b"


def test_a_json_task_file_is_accepted():
    assert load_config(None, [*ENCODER_CLASSIFIER, "--task.file=rows.json"]).task.file == "rows.json"


def test_the_bottom_of_each_closed_range_is_accepted():
    cfg = load_config(None, ["--schedule.min_lr_ratio=0", "--optim.weight_decay=0", "--optim.grad_clip=0"])
    assert (cfg.schedule.min_lr_ratio, cfg.optim.weight_decay, cfg.optim.grad_clip) == (0.0, 0.0, 0.0)
