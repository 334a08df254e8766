#include "dispatch.h"

#include <atomic>
#include <cstdlib>

namespace lowbit {
namespace {

struct IsaEntry {
  const char* name;
  const IsaKernels* (*table)();
  bool (*supported)();
};

#if defined(__x86_64__)
bool HasAvx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("bmi2");
}
bool HasAvx2Vnni() { return HasAvx2() && __builtin_cpu_supports("avxvnni"); }
bool HasAvx512Bw() {
  return HasAvx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}
bool HasAvx512Vnni() { return HasAvx512Bw() && __builtin_cpu_supports("avx512vnni"); }
bool HasAmx() { return HasAvx512Vnni() && AmxUsable(); }
#else
bool HasAvx2() { return false; }
bool HasAvx2Vnni() { return false; }
bool HasAvx512Bw() { return false; }
bool HasAvx512Vnni() { return false; }
bool HasAmx() { return false; }
#endif
bool Always() { return true; }

// Ordered slowest to fastest; capping walks down this list.
const IsaEntry kIsas[] = {
    {"scalar", IsaScalar, Always},
    {"avx2", IsaAvx2, HasAvx2},
    {"avx2vnni", IsaAvx2Vnni, HasAvx2Vnni},
    {"avx512bw", IsaAvx512Bw, HasAvx512Bw},
    {"avx512vnni", IsaAvx512Vnni, HasAvx512Vnni},
    {"amx", IsaAmx, HasAmx},
};
constexpr int kNumIsas = sizeof(kIsas) / sizeof(kIsas[0]);

int Capped(int want) {
  for (int i = want; i > 0; --i) {
    if (kIsas[i].supported() && kIsas[i].table() != nullptr) return i;
  }
  return 0;
}

int IndexOf(const std::string& name) {
  for (int i = 0; i < kNumIsas; ++i) {
    if (name == kIsas[i].name) return i;
  }
  return -1;
}

std::atomic<const IsaKernels*>& Active() {
  static std::atomic<const IsaKernels*> active{[] {
    int want = kNumIsas - 1;
    if (const char* env = std::getenv("LOWBIT_CPU_ISA")) {
      const int i = IndexOf(env);
      if (i >= 0) want = i;
    }
    return kIsas[Capped(want)].table();
  }()};
  return active;
}

}  // namespace

std::vector<std::string> SupportedIsas() {
  std::vector<std::string> out;
  for (int i = 0; i < kNumIsas; ++i) {
    if (kIsas[i].supported() && kIsas[i].table() != nullptr) out.push_back(kIsas[i].name);
  }
  return out;
}

const IsaKernels* ActiveIsa() { return Active().load(std::memory_order_acquire); }

std::string SelectIsa(const std::string& name) {
  const int i = IndexOf(name);
  if (i < 0) return std::string();
  const IsaKernels* t = kIsas[Capped(i)].table();
  Active().store(t, std::memory_order_release);
  return t->name;
}

}  // namespace lowbit
