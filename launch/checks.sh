# Sourced by the launch scripts: their checks of the environment variables they read, each a one-line error
# naming the variable (exit 2) before a launcher starts, as lm's tools refuse bad input.
die() { echo "error: $*" >&2; exit 2; }
count() { [[ "$2" =~ ^[1-9][0-9]*$ ]] || die "$1 must be a positive integer, got '$2'"; }
natural() { [[ "$2" =~ ^[0-9]+$ ]] || die "$1 must be 0 or a positive integer, got '$2'"; }
port() { [[ "$2" =~ ^[1-9][0-9]{0,4}$ ]] && (( $2 <= 65535 )) || die "$1 must be a port number, 1 to 65535, got '$2'"; }
