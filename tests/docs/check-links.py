#!/usr/bin/env python3
"""Every relative link and anchor in README.md and docs/ resolves.

    tests/docs/check-links.py            # the repository's Markdown
    tests/docs/check-links.py FILE...    # these files
    tests/docs/check-links.py --self-test

Offline: links with a scheme (https:, mailto:) are not fetched. A relative
link must name a file or directory of the repository; a `#anchor` must name
a heading of its file the way GitHub renders it (lower case, punctuation
dropped, spaces as '-', a repeated heading suffixed -1, -2, ...) or an
explicit `<a id="...">`. Links inside code spans and fenced blocks are text,
not links. Exits 1 naming each broken link with its file and line.
"""
import os
import re
import sys
import tempfile

LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
IMAGE = re.compile(r"!\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ID = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
FENCE = re.compile(r"^\s{0,3}(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?:.+?)\1")


def slug(heading):
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"<[^>]+>", "", heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link's text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def prose_lines(path, keep_code=False):
    """(line number, line) outside fenced blocks; code spans removed unless
    `keep_code` (a heading's anchor keeps their text)."""
    fenced = False
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if FENCE.match(line):
                fenced = not fenced
                continue
            if not fenced:
                yield n, line if keep_code else CODE_SPAN.sub("", line)


def anchors(path, cache={}):
    if path not in cache:
        found, seen = set(), {}
        for _, line in prose_lines(path, keep_code=True):
            for a in HTML_ID.findall(line):
                found.add(a)
            m = HEADING.match(line)
            if m:
                base = slug(m.group(2))
                n = seen.get(base, 0)
                seen[base] = n + 1
                found.add(base if n == 0 else f"{base}-{n}")
        cache[path] = found
    return cache[path]


def broken_links(path, root):
    """(line, target, why) for each link of `path` that does not resolve."""
    out = []
    for n, line in prose_lines(path):
        targets = LINK.findall(line) + IMAGE.findall(line)
        m = REFERENCE.match(line)
        if m:
            targets.append(m.group(1))
        for target in targets:
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):
                continue  # https:, mailto: ... are not checked offline
            file_part, _, anchor = target.partition("#")
            if file_part:
                dest = os.path.normpath(os.path.join(os.path.dirname(path), file_part))
                if not os.path.realpath(dest).startswith(os.path.realpath(root) + os.sep) \
                        and os.path.realpath(dest) != os.path.realpath(root):
                    out.append((n, target, "points outside the repository"))
                    continue
                if not os.path.exists(dest):
                    out.append((n, target, "no such file"))
                    continue
            else:
                dest = path
            if anchor and dest.endswith(".md") and os.path.isfile(dest):
                if anchor not in anchors(dest):
                    out.append((n, target, f"no heading or id '{anchor}' in {os.path.relpath(dest, root)}"))
    return out


def markdown_files(root):
    files = [os.path.join(root, "README.md")]
    for d, _, names in os.walk(os.path.join(root, "docs")):
        files += [os.path.join(d, x) for x in sorted(names) if x.endswith(".md")]
    return [f for f in files if os.path.isfile(f)]


def check(files, root):
    bad = 0
    for f in files:
        for n, target, why in broken_links(f, root):
            print(f"{os.path.relpath(f, root)}:{n}: ({target}): {why}")
            bad += 1
    return bad


def self_test():
    """The checker finds a broken file, a broken anchor and a link leaving
    the tree, and passes sound links, repeated headings and code."""
    with tempfile.TemporaryDirectory() as root:
        os.makedirs(os.path.join(root, "docs"))
        with open(os.path.join(root, "docs", "guide.md"), "w") as f:
            f.write("# Run it\n## Flags and `config`\n## Flags and `config`\n<a id=\"kept\"></a>\n")
        good = (
            "# Top\n[guide](docs/guide.md) [run](docs/guide.md#run-it)\n"
            "[flags](docs/guide.md#flags-and-config-1) [kept](docs/guide.md#kept) [self](#top)\n"
            "[web](https://example.org/x) `[code](nowhere.md)`\n```\n[fenced](nowhere.md)\n```\n"
            "[ref]: docs/guide.md#run-it\n"
        )
        with open(os.path.join(root, "README.md"), "w") as f:
            f.write(good)
        assert check(markdown_files(root), root) == 0, "sound links were refused"
        with open(os.path.join(root, "README.md"), "w") as f:
            f.write(good + "[gone](docs/gone.md)\n[typo](docs/guide.md#run-itt)\n[out](../secret.md)\n")
        found = broken_links(os.path.join(root, "README.md"), root)
        assert [t for _, t, _ in found] == ["docs/gone.md", "docs/guide.md#run-itt", "../secret.md"], found
    print("check-links self-test passed")


def main(argv):
    root = os.path.realpath(os.path.join(os.path.dirname(__file__), "..", ".."))
    if argv[1:] == ["--self-test"]:
        self_test()
        return 0
    files = [os.path.realpath(a) for a in argv[1:]] or markdown_files(root)
    bad = check(files, root)
    if bad:
        print(f"{bad} broken link(s)", file=sys.stderr)
        return 1
    print(f"every relative link and anchor resolves ({len(files)} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
