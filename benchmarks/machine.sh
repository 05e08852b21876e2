# Sourced by the GPU scripts: machine_name prints this machine's kind from its GPUs, as the device
# tool names them: "nvidia-h200" for one H200, "nvidia-h200-x2" for two, "cpu" without nvidia-smi.
machine_name() {
  local name count
  name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  count=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  if [[ -z "$name" || "$count" -eq 0 ]]; then echo cpu; return; fi
  name=$(echo "$name" | tr '[:upper:]' '[:lower:]' | tr -s ' ' '-')
  if [[ "$count" -gt 1 ]]; then echo "$name-x$count"; else echo "$name"; fi
}
