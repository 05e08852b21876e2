# Sourced by setup-env.sh, setup-sglang-env.sh and check-wheels.sh: installs into a virtualenv with uv
# (several times faster than pip here), and with pip only where uv cannot be had.
#   venv_install VENV ARGS...      what `pip install ARGS...` would do in VENV (-e, --no-deps, pins)
#   venv_uninstall VENV NAMES...   removes NAMES from VENV; a name that is not installed is no error
# Every installed module is compiled at install, as pip does: with PYTHONDONTWRITEBYTECODE=1 (set here), a
# venv without .pyc files compiles its imports again in every process.
# uv reads none of pip's configuration, so the machine's (pip config list: find-links, index URLs,
# constraints, certificate) is handed to it, and it weighs all indexes as pip does (unsafe-best-match):
# the same packages and pins come from the same places (the CPU torch wheel on this disk, for one).

# uv from $UV, the PATH, .venv (setup-env.sh puts it there) or VENV itself, installed with pip if need be
_uv_for() {
    local venv=$1 candidate
    for candidate in "${UV:-}" "$(command -v uv || true)" .venv/bin/uv "$venv/bin/uv"; do
        [ -n "$candidate" ] && [ -x "$candidate" ] && { echo "$candidate"; return 0; }
    done
    "$venv/bin/python" -m pip install -q --disable-pip-version-check uv >/dev/null 2>&1 && [ -x "$venv/bin/uv" ] \
        && echo "$venv/bin/uv"
}

# pip's configuration of VENV's pip as uv options, one a line
_uv_options_from_pip() {
    "$1/bin/python" -m pip config list 2>/dev/null | "$1/bin/python" -c '
import ast, sys
flags = {"find-links": "--find-links", "index-url": "--index-url", "extra-index-url": "--extra-index-url",
         "constraint": "--constraint"}
seen = []
for line in sys.stdin:
    key, _, value = line.rstrip("\n").partition("=")
    flag = flags.get(key.rpartition(".")[2])
    if flag:
        seen += [(flag, item) for item in ast.literal_eval(value).split() if (flag, item) not in seen]
for flag, item in seen:
    print(flag, item, sep="\n")
'
}

# pip's certificate setting, for uv's SSL_CERT_FILE
_pip_cert() {
    "$1/bin/python" -m pip config list 2>/dev/null | sed -n "s/^[^=]*\.cert='\(.*\)'$/\1/p" | head -1
}

_pip_quiet() {
    # pip's notes about this machine's package folders and about deliberately missing dependency trees are
    # noise; its exit status is not
    "$@" 2>&1 | { grep -v -e "^WARNING: Location" -e " requires .*, which is not installed" \
        -e "dependency resolver" || true; }
    return "${PIPESTATUS[0]}"
}

venv_install() {
    local venv=$1 uv cert
    shift
    if uv=$(_uv_for "$venv"); then
        local options=()
        mapfile -t options < <(_uv_options_from_pip "$venv")
        cert=$(_pip_cert "$venv")
        # uv's timings stay in the log (resolved, prepared, installed, compiled), its list of packages does not
        SSL_CERT_FILE=${SSL_CERT_FILE:-$cert} "$uv" pip install --python "$venv/bin/python" \
            --index-strategy unsafe-best-match --compile-bytecode "${options[@]}" "$@" 2>&1 \
            | { grep -v -e "^ [-+~] " || true; }
        return "${PIPESTATUS[0]}"
    else
        echo "installer: uv could not be installed; installing with pip" >&2
        _pip_quiet "$venv/bin/python" -m pip install -q --disable-pip-version-check "$@"
    fi
}

venv_uninstall() {
    local venv=$1 uv
    shift
    if uv=$(_uv_for "$venv"); then
        "$uv" pip uninstall -q --python "$venv/bin/python" "$@" 2>/dev/null || true
    else
        "$venv/bin/python" -m pip uninstall -q -y "$@" 2>/dev/null || true
    fi
}
