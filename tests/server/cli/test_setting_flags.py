"""The server's own ``serve`` flags are generated from its settings, as the engine's are: one
definition per setting (server/config.py), each flag landing on its key."""

import argparse

import pytest

from xinserve.server.cli.main import SECTION_FLAGS, _add_serve_args, build_config
from xinserve.server.cli.setting_flags import flag_fields

# The flags ``serve`` had when they were written by hand: generating them kept every name.
SERVER_FLAGS = {"--host", "--port", "--api-key", "--request-timeout", "--trust-request-chat-template",
                "--nnodes", "--node-rank", "--master-addr", "--master-port", "--metric-prefix"}
# Flag -> (its value on the command line, the key it sets, the value the config then holds)
SAMPLES = {
    "--host": ("127.0.0.2", ("server", "host"), "127.0.0.2"),
    "--port": ("9001", ("server", "port"), 9001),
    "--request-timeout": ("2.5", ("server", "request_timeout_s"), 2.5),
    "--nnodes": ("2", ("distributed", "nnodes"), 2),
    "--node-rank": ("1", ("distributed", "node_rank"), 1),
    "--master-addr": ("10.0.0.1", ("distributed", "master_addr"), "10.0.0.1"),
    "--master-port": ("29500", ("distributed", "master_port"), 29500),
    "--metric-prefix": ("vllm", ("metrics", "prefix"), "vllm"),
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    _add_serve_args(p)
    return p


def test_every_described_server_setting_is_a_flag_and_no_flag_was_renamed():
    generated = {"--" + dest.replace("_", "-") for settings in SECTION_FLAGS.values() for dest in flag_fields(settings)}
    assert generated == SERVER_FLAGS
    options = {o for action in parser()._actions for o in action.option_strings}
    assert SERVER_FLAGS <= options
    for settings in SECTION_FLAGS.values():  # the help is the field's description, the default its default
        for dest, name in flag_fields(settings).items():
            action = next(a for a in parser()._actions if a.dest == dest)
            assert action.help == settings.model_fields[name].description and action.default is None


@pytest.mark.parametrize("flag", sorted(SAMPLES))
def test_a_server_flag_sets_its_key_and_not_given_leaves_the_default(flag):
    text, (section, key), value = SAMPLES[flag]
    # Several nodes need an explicit rendezvous port; a second node's rank needs a second node.
    extra = {"--nnodes": ["--master-port", "29500"], "--node-rank": ["--nnodes", "2", "--master-port", "29500"]}
    extra = extra.get(flag, [])
    config = build_config(parser().parse_args(["--model", "/m", *extra, flag, text]), env={})
    assert getattr(getattr(config, section), key) == value
    plain = build_config(parser().parse_args(["--model", "/m"]), env={})
    assert getattr(getattr(plain, section), key) == SECTION_FLAGS[section].model_fields[key].default


def test_api_keys_append_to_the_files_then_the_environments(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("server: {api_keys: [k0]}\nmodels: [{name: m, path: /m}]\n")
    args = parser().parse_args(["--config", str(path), "--api-key", "k1", "--api-key", "k2"])
    assert build_config(args, env={"XINSERVE_API_KEY": "k3"}).server.api_keys == ["k0", "k1", "k2", "k3"]


def test_a_boolean_server_flag_turns_the_setting_on_or_off(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("server: {trust_request_chat_template: true}\nmodels: [{name: m, path: /m}]\n")
    on = build_config(parser().parse_args(["--config", str(path)]), env={})
    off = build_config(parser().parse_args(["--config", str(path), "--no-trust-request-chat-template"]), env={})
    assert (on.server.trust_request_chat_template, off.server.trust_request_chat_template) == (True, False)
