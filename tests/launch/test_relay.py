"""The ranks' output under tpcore.spawn and python -m tpcore.launch: one prefix a line,
and a carriage-return progress line is one line per update (pipes, files, notebooks)
or one line drawn in place (terminals), never "[rank0] [rank0] loading ...".  The
cutting and drawing live in tpcore/_relay.py."""
import io
import re
import subprocess
import sys

from conftest import run
from tpcore.launch.relay import Console

LAUNCH = [sys.executable, "-m", "tpcore.launch"]

# what a rank prints: a hand-made progress bar (each update flushed, as tqdm and tpcore's
# loader do), tpcore's own loading bar, an empty line, and a last line without a newline
CHILD = r'''
import sys, time
def progress(rank):
    err = sys.stderr
    err.write("\rloading [#.] 1/2 blocks")
    err.flush()
    err.write("\rloading [##] 2/2 blocks")
    err.flush()
    err.write("\n")
    err.flush()
    print(f"hello from rank {rank}")
    print()
    print("a\r\nb")
    from tpcore.models.state import _Progress
    bar = _Progress(2, True)
    bar.step()
    bar.step()
    bar.done()
    sys.stdout.write("tail without a newline")
    sys.stdout.flush()
'''
_NS: dict = {}
exec(CHILD, _NS)
progress = _NS["progress"]

BAR = re.compile(r"loading \[#{15}\.{15}\] 1/2 blocks \d+\.\ds$|loading \[#{30}\] 2/2 blocks \d+\.\ds$")


def _check(out, err, prefix, ranks):
    for r in ranks:
        p = prefix.format(r=r)
        mine_out = [ln[len(p):] for ln in out.split("\n") if ln.startswith(p)]
        mine_err = [ln[len(p):] for ln in err.split("\n") if ln.startswith(p)]
        assert mine_out == [f"hello from rank {r}", "", "a", "b", "tail without a newline"], out
        assert mine_err[:2] == ["loading [#.] 1/2 blocks", "loading [##] 2/2 blocks"], err
        if r == 0 or len(mine_err) > 2:
            assert len(mine_err) == 4 and all(BAR.match(ln) for ln in mine_err[2:]), err
    for text in (out, err):
        assert "\r" not in text, repr(text)
        for ln in text.split("\n"):
            if ln:
                assert re.match(prefix.replace("[", r"\[").replace("]", r"\]").format(r=r"\d") + r"(?!\[rank)", ln), \
                    f"a line without exactly one prefix: {ln!r}"


def _spawned(comm):
    progress(comm.rank)


def test_spawn_prefixes_each_update_once(capsys):
    run(_spawned, 2)
    cap = capsys.readouterr()
    _check(cap.out, cap.err, "[rank{r}] ", range(2))


def test_launcher_prefixes_each_update_once(tmp_path):
    p = tmp_path / "job.py"
    p.write_text(CHILD + "\nimport os\nprogress(int(os.environ['RANK']))\n")
    r = subprocess.run(LAUNCH + ["-n", "2", str(p)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    _check(r.stdout, r.stderr, "[rank{r}] ", range(2))


# -- the relay itself -------------------------------------------------------------
def _relay(tty, prefix="[rank0] "):
    console = Console()
    buf = io.StringIO()
    return console, console.relay(lambda: buf, prefix, tty=tty), buf


def test_pipe_lines_exactly():
    _, rel, buf = _relay(False)
    for chunk in ("\rload 1/3", "\rload 2/3", "\r", "load 3/3\r", "\n", "x\r\ny\n", "\n", "part", "ial\r", "z"):
        rel.feed(chunk)
    rel.close()
    assert buf.getvalue() == ("[rank0] load 1/3\n[rank0] load 2/3\n[rank0] load 3/3\n[rank0] x\n[rank0] y\n"
                              "[rank0] \n[rank0] partial\n[rank0] z\n")


def test_bytes_cut_inside_a_character():
    _, rel, buf = _relay(False)
    data = "é\r€\n".encode()
    for i in range(len(data)):
        rel.feed_bytes(data[i:i + 1])
    rel.close()
    assert buf.getvalue() == "[rank0] é\n[rank0] €\n"


def test_terminal_draws_one_line_in_place():
    _, rel, buf = _relay(True)
    rel.feed("\rloading 1/2")
    rel.feed("\rloading 2/2")
    rel.feed("\n")
    rel.feed("done\n")
    assert buf.getvalue() == "\r[rank0] loading 1/2\x1b[K\r[rank0] loading 2/2\x1b[K\n[rank0] done\n"


def test_terminal_other_rank_ends_the_line_being_drawn():
    console = Console()
    buf = io.StringIO()
    a = console.relay(lambda: buf, "[rank0] ", tty=True)
    b = console.relay(lambda: buf, "[rank1] ", tty=True)
    a.feed("\rloading 1/2")
    b.feed("hi\n")
    a.feed("\rloading 2/2\n")
    console.write(buf, "note\n")
    assert buf.getvalue() == "\r[rank0] loading 1/2\x1b[K\n[rank1] hi\n[rank0] loading 2/2\nnote\n"
