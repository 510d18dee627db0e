"""NeMo-Run's git packager for checkouts and job folders whose paths need shell quoting.

NeMo-Run's ``GitArchivePackager.package`` builds shell commands such as ``cd {path} && git rev-parse``
with the checkout's and the job folder's paths unquoted, so a checkout under a folder with a space
(``~/My Projects/hacrl``) fails before anything is shipped. :class:`QuotingGitArchivePackager` archives
such paths itself with ``git -C PATH archive`` (no shell): the same archive, the committed tree at
``ref`` (under ``subpath``), gzip-compressed. Every other path goes through NeMo-Run's own code
unchanged. Submodules and include patterns are refused on such paths, naming the path (NeMo-Run's
shell pipeline for them cannot be made safe from outside). Importing this module imports ``nemo_run``.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import nemo_run as run


def shell_safe(*paths: object) -> bool:
    """Whether every path reads the same inside a shell command unquoted."""
    return all(shlex.quote(str(p)) == str(p) for p in paths)


def _git(where: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"packager=git: `git {' '.join(args)}` in {str(where)!r} failed: {done.stderr.strip()}")
    return done.stdout


class QuotingGitArchivePackager(run.GitArchivePackager):
    """``GitArchivePackager`` that also ships a checkout or into a job folder whose path needs quoting."""

    def package(self, path: Path, job_dir: str, name: str) -> str:
        base = Path(self.basepath) if self.basepath else Path(path)
        if shell_safe(base, job_dir):
            return super().package(path, job_dir, name)
        output_file = os.path.join(job_dir, f"{name}.tar.gz")
        if os.path.exists(output_file):
            return output_file
        top = _git(base, "rev-parse", "--show-toplevel").strip()
        patterns = [self.include_pattern] if isinstance(self.include_pattern, str) else self.include_pattern
        if (self.include_submodules and (Path(top) / ".gitmodules").exists()) or any(patterns):
            raise RuntimeError(f"packager=git: the checkout {top!r} or the job folder {job_dir!r} has a space or a "
                               "quote in its path, and NeMo-Run's packager cannot ship submodules or include patterns "
                               "from there: move the checkout to a plain path, or use --packager none")
        if self.check_uncommitted_changes and _git(Path(top), "status", "--porcelain", "--untracked-files=no").strip():
            raise RuntimeError(f"packager=git: {top!r} has uncommitted changes; commit them (only committed files "
                               "are shipped) or set check_uncommitted_changes to False")
        if self.check_untracked_files and _git(Path(top), "ls-files", "--others", "--exclude-standard").strip():
            raise RuntimeError(f"packager=git: {top!r} has untracked files; add them or set check_untracked_files "
                               "to False")
        partial = f"{output_file}.tmp"
        _git(Path(top), "archive", "--format=tar.gz", f"--output={partial}", f"{self.ref}:{os.path.join(self.subpath, '')}")
        os.replace(partial, output_file)  # a killed packaging leaves no half archive under the final name
        return output_file
