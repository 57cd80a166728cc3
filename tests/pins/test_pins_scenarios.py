"""check-pins on real repositories with real nested submodules: one test per situation."""

from __future__ import annotations

from pins_helpers import (
    BRIDGE_PATH,
    EMO_URL,
    LM_PATH,
    REPO_ROOT,
    add_submodule,
    bridge_toml,
    check_pins,
    commit_all,
    git,
    line_of,
    lm_toml,
    make_repo,
    root_toml,
)


def test_consistent_repository_passes(nested):
    layout = nested()
    result = check_pins("--repo", layout.root)
    assert result.code == 0, result.out
    assert "ok: 3 pyproject.toml files, 2 submodules, no pin drift" in result.out


def test_emerging_optimizers_incident_names_package_values_files_lines_and_fix(nested):
    """Root constraint v0.2.0, nested Megatron-LM (inside Megatron-Bridge) v0.3.0."""
    layout = nested(root=root_toml(emo="v0.2.0"), lm=lm_toml(emo="v0.3.0"))
    result = check_pins("--repo", layout.root)
    assert result.code == 1
    root_line = line_of(layout.root / "pyproject.toml", "@v0.2.0")
    lm_line = line_of(layout.lm / "pyproject.toml", 'rev = "v0.3.0"')
    out = result.out
    assert "error[RF001]: conflicting git revs for `emerging-optimizers`" in out
    assert "the root pins `v0.2.0`" in out and "pins `v0.3.0`" in out
    assert f"--> pyproject.toml:{root_line}:" in out
    assert f"{LM_PATH}/pyproject.toml:{lm_line}" in out
    assert (
        f'help: set the requirement to "emerging-optimizers @ git+{EMO_URL}@v0.3.0" at pyproject.toml:{root_line}'
        in out
    )
    assert "1 error, 0 warnings" in out


def test_incident_as_json_for_tools(nested):
    layout = nested(root=root_toml(emo="v0.2.0"))
    result = check_pins("--repo", layout.root, "--format", "json")
    assert result.code == 1
    (finding,) = result.json["diagnostics"]
    assert finding["code"] == "RF001" and finding["package"] == "emerging-optimizers"
    assert finding["ours"]["file"] == "pyproject.toml"
    assert finding["ours"]["line"] == line_of(layout.root / "pyproject.toml", "@v0.2.0")
    assert finding["theirs"][0]["file"] == f"{LM_PATH}/pyproject.toml"
    assert finding["theirs"][0]["value"] == "v0.3.0"
    assert result.json["exit_code"] == 1


def test_source_table_pin_gets_a_rev_fix_line(nested):
    body = f'emerging-optimizers = {{ git = "{EMO_URL}", rev = "v0.2.0" }}\n'
    root = root_toml(body=body).replace(
        f'"emerging-optimizers @ git+{EMO_URL}@v0.3.0",', '"emerging-optimizers",'
    )
    layout = nested(root=root)
    result = check_pins("--repo", layout.root)
    line = line_of(layout.root / "pyproject.toml", 'rev = "v0.2.0"')
    assert result.code == 1
    assert f'help: set rev = "v0.3.0" at pyproject.toml:{line}' in result.out
    # A `tag` stays a `tag` (the issue-11 --fix renamed it)...
    path = layout.root / "pyproject.toml"
    path.write_text(path.read_text().replace('rev = "v0.2.0"', 'tag = "v0.2.0"'))
    result = check_pins("--repo", layout.root)
    assert f'help: set tag = "v0.3.0" at pyproject.toml:{line}' in result.out
    # ...unless the submodule pins a commit, which a `tag` key cannot hold.
    lm = layout.lm / "pyproject.toml"
    lm.write_text(lm.read_text().replace('rev = "v0.3.0"', 'rev = "0123abcd"'))
    result = check_pins("--repo", layout.root)
    assert 'help: set rev = "0123abcd" (instead of `tag`: a commit)' in result.out


def test_url_spelling_differences_are_not_conflicts(nested):
    """git+https vs https, a .git suffix and a trailing slash name the same repository."""
    spelled = EMO_URL.removesuffix(".git") + "/"
    lm = lm_toml().replace(f'git = "{EMO_URL}"', f'git = "{spelled}"')
    layout = nested(lm=lm)
    assert check_pins("--repo", layout.root).code == 0


def test_uninitialized_submodule_warns_and_fails_under_strict(nested, tmp_path):
    layout = nested()
    clone = tmp_path / "fresh-clone"
    git(tmp_path, "clone", "-q", str(layout.root), str(clone))  # no --recurse-submodules
    result = check_pins("--repo", clone)
    assert result.code == 0
    assert "warning[RF007]: submodule `submodules/Megatron-Bridge` is not initialized" in result.out
    assert "git submodule update --init --recursive submodules/Megatron-Bridge" in result.out
    strict = check_pins("--repo", clone, "--strict")
    assert strict.code == 1 and "error[RF007]" in strict.out


def test_uninitialized_nested_submodule(nested, tmp_path):
    layout = nested()
    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", str(layout.root), str(clone))
    git(clone, "submodule", "update", "-q", "--init")  # Megatron-Bridge only, not its Megatron-LM
    result = check_pins("--repo", clone, "--format", "json")
    assert result.code == 0
    (finding,) = result.json["diagnostics"]
    assert finding["code"] == "RF007" and finding["submodule"]["path"] == LM_PATH


def test_gitlink_differs_from_checkout(nested):
    layout = nested()
    (layout.lm / "README.md").write_text("moved on\n")
    commit_all(layout.lm, "local commit in the nested submodule")
    result = check_pins("--repo", layout.root, "--format", "json")
    assert result.code == 1
    (finding,) = result.json["diagnostics"]
    assert finding["code"] == "RF006"
    assert finding["submodule"]["head"] == git(layout.lm, "rev-parse", "HEAD").strip()
    assert finding["file"] == "submodules/Megatron-Bridge/.gitmodules"
    git(layout.bridge, "add", "3rdparty/Megatron-LM")  # staged, not committed in Bridge: RF014
    assert check_pins("--repo", layout.root, "--format", "json").codes() == ["RF014"]
    git(layout.bridge, "commit", "-qm", "bump Megatron-LM")
    git(layout.root, "add", BRIDGE_PATH)
    assert check_pins("--repo", layout.root).code == 0


def test_uncommitted_pyproject_in_submodule(nested):
    layout = nested()
    path = layout.bridge / "pyproject.toml"
    path.write_text(path.read_text() + "# local experiment\n")
    result = check_pins("--repo", layout.root)
    assert result.code == 1
    assert (
        "error[RF008]: `submodules/Megatron-Bridge/pyproject.toml` has uncommitted changes"
        in result.out
    )


def test_index_url_trailing_slash(nested):
    index = '[[tool.uv.index]]\nname = "flashinfer"\nurl = "{url}"\nexplicit = true\n'
    layout = nested(
        root=root_toml(body=index.format(url="https://flashinfer.ai/whl")),
        bridge=bridge_toml(body=index.format(url="https://flashinfer.ai/whl/")),
    )
    result = check_pins("--repo", layout.root)
    assert result.code == 1
    assert "error[RF003]: index `flashinfer` has two URLs" in result.out
    assert "https://flashinfer.ai/whl/" in result.out
    line = line_of(layout.root / "pyproject.toml", 'url = "https://flashinfer.ai/whl"')
    assert f'help: set url = "https://flashinfer.ai/whl/" at pyproject.toml:{line}' in result.out


def test_disjoint_exact_versions(nested):
    root = root_toml().replace(
        'mcore = ["megatron-bridge"]',
        'mcore = ["megatron-bridge", "flashinfer-python==0.6.8.post1"]',
    )
    bridge = bridge_toml(deps='"megatron-core[dev]", "flashinfer-python==0.6.18.post1"')
    layout = nested(root=root, bridge=bridge)
    result = check_pins("--repo", layout.root)
    assert result.code == 1
    assert (
        "error[RF004]: no version of `flashinfer-python` satisfies both `==0.6.8.post1` "
        "(the root) and `==0.6.18.post1`"
    ) in result.out


def test_overlapping_version_ranges_are_fine(nested):
    root = root_toml().replace(
        'mcore = ["megatron-bridge"]', 'mcore = ["megatron-bridge", "transformers>=5.0,<6"]'
    )
    bridge = bridge_toml(deps='"megatron-core[dev]", "transformers==5.17.0"')
    assert check_pins("--repo", nested(root=root, bridge=bridge).root).code == 0


def test_extras_declared_conflicting_resolve_separately(nested):
    """NeMo-RL's vllm extra pins flashinfer 0.6.13; Megatron-Bridge (mcore extra) 0.6.18."""
    root = (
        root_toml(body="")
        .replace(
            'mcore = ["megatron-bridge"]',
            'mcore = ["megatron-bridge"]\nvllm = ["flashinfer-python==0.6.13"]',
        )
        .replace(
            "[tool.uv]\n", '[tool.uv]\nconflicts = [[{ extra = "mcore" }, { extra = "vllm" }]]\n'
        )
    )
    bridge = bridge_toml(deps='"megatron-core[dev]", "flashinfer-python==0.6.18.post1"')
    assert check_pins("--repo", nested(root=root, bridge=bridge).root).code == 0


def test_root_override_wins(nested):
    root = root_toml(emo="v0.2.0").replace(
        "[tool.uv]\n",
        f'[tool.uv]\noverride-dependencies = ["emerging-optimizers @ git+{EMO_URL}@v0.2.0"]\n',
    )
    assert check_pins("--repo", nested(root=root).root).code == 0


def test_allowlisted_difference_with_reason(nested):
    policy = (
        '[tool.rlflow.pins]\nallow = [{ package = "emerging_optimizers", code = "RF001", '
        'reason = "we test v0.2.0 on purpose" }]\n'
    )
    layout = nested(root=root_toml(emo="v0.2.0", body=policy))
    result = check_pins("--repo", layout.root)
    assert result.code == 0, result.out
    assert "allowed[RF001]: `emerging-optimizers` (we test v0.2.0 on purpose)" in result.out


def test_allow_entry_without_reason_is_unusable_input(nested):
    policy = '[tool.rlflow.pins]\nallow = [{ package = "emerging-optimizers" }]\n'
    result = check_pins("--repo", nested(root=root_toml(body=policy)).root)
    assert result.code == 2
    assert "error[RF104]: allow entry needs a non-empty `reason`" in result.err
    assert "--> pyproject.toml:" in result.err


def test_unknown_policy_key_suggests_the_right_one(nested):
    policy = '[tool.rlflow.pins]\nlockstepp = ["torch"]\n'
    result = check_pins("--repo", nested(root=root_toml(body=policy)).root)
    assert result.code == 2
    assert "unknown key `lockstepp`" in result.err and "did you mean `lockstep`?" in result.err


def test_stale_allow_entry_is_reported(nested):
    policy = '[tool.rlflow.pins]\nallow = [{ package = "nemo-run", reason = "old" }]\n'
    result = check_pins("--repo", nested(root=root_toml(body=policy)).root)
    assert result.code == 0
    assert (
        "warning[RF009]: [tool.rlflow.pins] allow entry for `nemo-run` matches nothing"
        in result.out
    )


def test_lockstep_package_must_match_exactly(nested):
    """transformers>=5.0 (root) and ==5.17.0 (bridge) overlap, but lockstep wants one pin."""
    root = root_toml(body='[tool.rlflow.pins]\nlockstep = ["transformers"]\n').replace(
        'mcore = ["megatron-bridge"]', 'mcore = ["megatron-bridge", "transformers>=5.0"]'
    )
    bridge = bridge_toml(deps='"megatron-core[dev]", "transformers==5.17.0"')
    result = check_pins("--repo", nested(root=root, bridge=bridge).root)
    assert result.code == 1
    assert "error[RF005]: `transformers` is in [tool.rlflow.pins] lockstep" in result.out


def test_pins_uv_never_installs_are_ignored(nested):
    """A submodule's dependency groups and unrequested extras are not installed: no conflict."""
    lm = lm_toml(
        body='nemo-run = { git = "https://github.com/NVIDIA-NeMo/Run.git", rev = "e393" }\n'
        'mamba-ssm = { git = "https://github.com/state-spaces/mamba.git", rev = "0048" }\n'
    )
    lm = lm.replace(
        'dev = ["emerging_optimizers", "einops"]',
        'dev = ["emerging_optimizers", "einops"]\nssm = ["mamba-ssm"]\n\n'
        '[dependency-groups]\ntest = ["nemo-run"]',
    )
    root = root_toml(
        body='nemo-run = { git = "https://github.com/NVIDIA-NeMo/Run.git", rev = "414f" }\n'
        'mamba-ssm = { git = "https://github.com/state-spaces/mamba.git", rev = "a14b" }\n'
    )
    root = root.replace(
        'dependencies = ["torch==2.11.0"]',
        'dependencies = ["torch==2.11.0", "nemo-run", "mamba-ssm"]',
    )
    layout = nested(root=root, lm=lm)
    assert check_pins("--repo", layout.root).code == 0
    # ...but once Megatron-Bridge asks for megatron-core[ssm], the mamba-ssm pins collide.
    bridge = layout.bridge / "pyproject.toml"
    bridge.write_text(bridge.read_text().replace("megatron-core[dev]", "megatron-core[dev,ssm]"))
    result = check_pins("--repo", layout.root, "--format", "json")
    packages = {(d["code"], d["package"]) for d in result.json["diagnostics"]}
    assert ("RF001", "mamba-ssm") in packages and ("RF001", "nemo-run") not in packages


def test_url_pin_of_a_path_dependency_is_accepted_like_uv_does(nested):
    """uv honours the sources of path dependencies: no root declaration needed, no warning."""
    root = root_toml().replace(
        f'    "emerging-optimizers @ git+{EMO_URL}@v0.3.0",  # bumped with the submodule\n', ""
    )
    result = check_pins("--repo", nested(root=root).root, "--strict")
    assert result.code == 0, result.out
    assert "RF002" not in result.out


def test_submodule_url_pin_not_declared_at_root_warns(nested):
    """Megatron-Bridge from an index, not by path: its checkout's git pins are not uv's."""
    root = root_toml().replace(
        f'    "emerging-optimizers @ git+{EMO_URL}@v0.3.0",  # bumped with the submodule\n', ""
    )
    root = root.replace(f'megatron-bridge = {{ path = "{BRIDGE_PATH}", editable = true }}', "")
    result = check_pins("--repo", nested(root=root).root)
    assert result.code == 0
    assert "warning[RF002]: `emerging-optimizers` is pinned by URL in submodule" in result.out
    assert (
        f"add `emerging-optimizers @ git+{EMO_URL}@v0.3.0` to [tool.uv] constraint-dependencies"
        in result.out
    )


def test_malformed_toml_names_file_line_column(nested):
    layout = nested()
    (layout.root / "pyproject.toml").write_text('[project]\nname = "x"\nversion = 0.1.0"\n')
    result = check_pins("--repo", layout.root)
    assert result.code == 2
    assert "error[RF102]: malformed TOML" in result.err
    assert "--> pyproject.toml:3:" in result.err
    assert "Traceback" not in result.err


def test_malformed_toml_in_nested_submodule(nested):
    layout = nested()
    (layout.lm / "pyproject.toml").write_text("[project\nname = 1\n")
    result = check_pins("--repo", layout.root, "--format", "json")
    assert result.code == 2
    (diag,) = result.json["diagnostics"]
    assert (
        diag["code"] == "RF102"
        and diag["file"] == f"{LM_PATH}/pyproject.toml"
        and diag["line"] == 1
    )


def test_invalid_requirement_is_unusable_input(nested):
    layout = nested(bridge=bridge_toml(deps='"megatron-core[dev", "torch"'))
    result = check_pins("--repo", layout.root)
    assert result.code == 2
    assert "error[RF103]: `megatron-core[dev` is not a valid requirement" in result.err
    assert "--> submodules/Megatron-Bridge/pyproject.toml:5:" in result.err


def test_not_a_git_repository(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\nversion = "0"\n')
    result = check_pins("--repo", tmp_path)
    assert result.code == 2
    assert "error[RF100]" in result.err and "is not inside a git repository" in result.err


def test_missing_pyproject(tmp_path):
    repo = make_repo(tmp_path / "repo", {"README.md": "no project here\n"})
    result = check_pins("--repo", repo)
    assert result.code == 2 and "error[RF101]: no pyproject.toml" in result.err


def test_repo_path_inside_the_repository_finds_its_root(nested):
    layout = nested(root=root_toml(emo="v0.2.0"))
    assert check_pins("--repo", layout.root / "submodules").code == 1


def test_submodule_without_pyproject_is_only_checked_for_state(nested, tmp_path):
    layout = nested()
    docs = make_repo(tmp_path / "upstream" / "docs", {"index.md": "# docs\n"})
    add_submodule(layout.root, docs, "submodules/docs")
    result = check_pins("--repo", layout.root)
    assert result.code == 0 and "3 pyproject.toml files, 3 submodules" in result.out


def test_this_repository_passes():
    """rlflow's own checkout: submodules/ empty or not initialized must still exit 0."""
    result = check_pins("--repo", REPO_ROOT)
    assert result.code == 0, result.out + result.err


def test_example_flag_shows_the_incident_and_exits_1():
    result = check_pins("--example")
    assert result.code == 1
    assert "error[RF001]: conflicting git revs for `emerging-optimizers`" in result.out
    assert "submodules/Megatron-Bridge/3rdparty/Megatron-LM/pyproject.toml" in result.out


def test_example_flag_with_fix_prints_the_diff_and_passes():
    result = check_pins("--example", "--fix")
    assert result.code == 0, result.out
    assert f'-    "emerging-optimizers @ git+{EMO_URL}@v0.2.0",' in result.out
    assert f'+    "emerging-optimizers @ git+{EMO_URL}@v0.3.0",' in result.out


def test_example_and_repo_together_is_a_usage_error(tmp_path):
    result = check_pins("--example", "--repo", tmp_path)
    assert result.code == 2 and "--example checks its own repository" in result.err
