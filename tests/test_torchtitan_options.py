"""Each torchtitan option titanlite lacks stops a run with its reason, on the command line and in
a TOML file, and none of them hides an option titanlite has."""

import pytest

from titanlite.config import ConfigError
from titanlite.config_parse import OPTIONS, parse_args
from titanlite.torchtitan_options import ADDED, NOT_IN_TITANLITE, NOT_YET, explain


def test_the_tables_name_only_options_titanlite_lacks_each_once():
    assert not set(NOT_IN_TITANLITE) & set(OPTIONS)
    assert not set(NOT_YET) & set(OPTIONS)
    assert not set(NOT_IN_TITANLITE) & set(NOT_YET)
    # torchtitan v0.2.2 had 61 options titanlite lacked; 6 of them are options now.
    assert len(NOT_IN_TITANLITE) + len(NOT_YET) == 55
    assert len(ADDED) == 6 and set(ADDED) <= set(OPTIONS)


def test_a_typo_is_still_a_typo():
    assert explain("training.gc_freqq") is None
    with pytest.raises(ConfigError, match=r"unknown option --training.gc_freqq; did you mean"):
        parse_args(["--training.gc_freqq", "5"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--fault_tolerance.enable"], "--fault_tolerance.enable: a torchtitan option titanlite "
         "does not have: TorchFT fault tolerance"),
        (["--parallelism.expert_parallel_degree", "2"], "does not have: titanlite has dense "
         "Llama models only"),
        (["--comm.trace_buf_size", "20000"], "does not have yet: set TORCH_FR_BUFFER_SIZE"),
    ],
)  # fmt: skip
def test_the_command_line_says_why(argv, message):
    with pytest.raises(ConfigError) as e:
        parse_args(argv)
    assert message in str(e.value)


@pytest.mark.parametrize(
    "toml, message",
    [
        ("[compile]\nenable = true\ncomponents = ['model', 'loss']\n",
         "compile.components: a torchtitan option titanlite does not have yet: compile.enable "
         "compiles each transformer block"),
        ("[fault_tolerance]\nenable = false\n",
         "[fault_tolerance] enable: a torchtitan option titanlite does not have: TorchFT"),
        ("[validation.dataloader]\nnum_workers = 2\n",
         "[validation.dataloader] num_workers: a torchtitan option titanlite does not have"),
    ],
)  # fmt: skip
def test_a_torchtitan_toml_says_why(tmp_path, toml, message):
    path = tmp_path / "job.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as e:
        parse_args(["--job.config_file", str(path)])
    assert message in str(e.value)


def test_the_new_options_parse():
    cfg = parse_args(["--training.gc_freq", "7", "--debug.deterministic_warn_only",
                      "--checkpoint.enable_first_step_checkpoint",
                      "--parallelism.pipeline_parallel_schedule_csv", "s.csv"])  # fmt: skip
    assert cfg.training.gc_freq == 7 and cfg.debug.deterministic_warn_only
    assert cfg.checkpoint.enable_first_step_checkpoint
    assert cfg.parallelism.pipeline_parallel_schedule_csv == "s.csv"
