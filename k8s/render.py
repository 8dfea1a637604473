"""Regenerates the parts of the KubeRay manifests that other files own, so the two cannot drift apart:

- `entrypoint` of k8s/rayjob-train.yaml: the command that README.md's `## Train` section runs with
  `ray job submit ... -- <command>` (its first such command); k8s/rayjob-train-gpu.yaml adds `use_gpu=true
  strategy=fsdp`;
- `serveConfigV2` of k8s/rayservice.yaml: serve_configs/kubernetes.yaml, verbatim.

    python k8s/render.py            # rewrite the manifests that are out of date
    python k8s/render.py --check    # only report them; exit status 1 if any (tests/test_k8s.py checks this)

Everything else in the manifests is written by hand and left as it is.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "k8s"
README = REPO / "README.md"
SERVE_CONFIG = REPO / "serve_configs" / "kubernetes.yaml"
GPU_OVERRIDES = ["use_gpu=true", "strategy=fsdp"]


def readme_section(readme: str, title: str) -> str:
    """The body of the `## <title>` section, up to the next heading of level 1 or 2."""
    match = re.search(rf"^## {re.escape(title)}[ \t]*\n(.*?)(?=^#{{1,2}} |\Z)", readme, re.M | re.S)
    if not match:
        raise ValueError(f"README has no `## {title}` section")
    return match.group(1)


def train_command(readme: str) -> list[str]:
    """The argv after `--` of the first `ray job submit` in the code blocks of the README's `## Train`."""
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", readme_section(readme, "Train"), re.M | re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if "job submit" not in " ".join(line.split()):
                continue
            words = shlex.split(line, comments=True)
            for i in range(len(words) - 2):
                if Path(words[i]).name == "ray" and words[i + 1 : i + 3] == ["job", "submit"]:
                    if "--" not in words[i + 3 :]:
                        raise ValueError(
                            f"README `## Train`: no `--` before the entrypoint in: {line.strip()}"
                        )
                    return words[words.index("--", i + 3) + 1 :]
    raise ValueError("README `## Train`: no `ray job submit ... -- <command>` in a code block")


def set_entrypoint(manifest: str, command: list[str]) -> str:
    """The manifest with its one `entrypoint:` line set to the command (a YAML scalar, quoted as needed)."""
    pattern = re.compile(r"^( *)entrypoint:.*$", re.M)
    if len(pattern.findall(manifest)) != 1:
        raise ValueError("expected exactly one `entrypoint:` line")
    line = yaml.safe_dump({"entrypoint": shlex.join(command)}, width=sys.maxsize).rstrip("\n")
    return pattern.sub(lambda m: m.group(1) + line, manifest)


def set_serve_config(manifest: str, serve_config: str) -> str:
    """The manifest with the literal block under its one `serveConfigV2: |` replaced by the serve config."""
    pattern = re.compile(r"^( *)serveConfigV2: \|\n(?:(?:\1  .*)?\n)*", re.M)
    if len(pattern.findall(manifest)) != 1:
        raise ValueError("expected exactly one `serveConfigV2: |` block")

    def block(match: re.Match) -> str:
        indent = match.group(1) + "  "
        lines = serve_config.strip("\n").splitlines()
        body = "".join(f"{indent}{line}".rstrip() + "\n" for line in lines)
        return f"{match.group(1)}serveConfigV2: |\n{body}"

    rendered = pattern.sub(block, manifest)
    embedded = yaml.safe_load(rendered)["spec"]["serveConfigV2"]
    if yaml.safe_load(embedded) != yaml.safe_load(serve_config):
        raise ValueError("the serve config does not survive embedding as a YAML block (its indentation?)")
    return rendered


def rendered(readme: str, serve_config: str) -> dict[Path, str]:
    """The generated manifests, from the README's text and the serve config's text."""
    command = train_command(readme)
    return {
        K8S / "rayjob-train.yaml": set_entrypoint((K8S / "rayjob-train.yaml").read_text(), command),
        K8S / "rayjob-train-gpu.yaml": set_entrypoint(
            (K8S / "rayjob-train-gpu.yaml").read_text(), command + GPU_OVERRIDES
        ),
        K8S / "rayservice.yaml": set_serve_config((K8S / "rayservice.yaml").read_text(), serve_config),
    }


def main(argv: list[str]) -> int:
    check = argv == ["--check"]
    if argv and not check:
        print(__doc__, file=sys.stderr)
        return 2
    stale = [
        (path, text)
        for path, text in rendered(README.read_text(), SERVE_CONFIG.read_text()).items()
        if path.read_text() != text
    ]
    for path, text in stale:
        if check:
            print(f"stale: {path.relative_to(REPO)} (run: python k8s/render.py)")
        else:
            path.write_text(text)
            print(f"rendered {path.relative_to(REPO)}")
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
