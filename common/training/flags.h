// flags.h — command-line flags: typed values with ranges, a --config file, nearest-flag
// suggestions for typos, grouped --help, and the effective values recorded in trainer.json.
#pragma once
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "formats/json.h"

namespace ts {

// Flags are declared where they are read (get_*), so --help lists exactly what a binary accepts;
// finish() rejects anything left over — an unknown flag is an error on every rank, never ignored,
// and names the declared flag nearest to it.

// The values a numeric flag accepts: [lo, hi], an end excluded when it is open. Every number must
// also be finite, and an integer flag's value a whole number its type holds (no wrap-around).
struct Range {
  double lo = -HUGE_VAL, hi = HUGE_VAL;
  bool lo_open = false, hi_open = false;
};
// The common ones, named for what they mean.
inline Range at_least(double lo) { return {lo, HUGE_VAL}; }
inline Range positive(double hi = HUGE_VAL) { return {0, hi, true, false}; }
inline Range between(double lo, double hi) { return {lo, hi}; }
// A mesh degree (--dp, --tp, --pp, --cp, --ep): ranks in one group.
inline Range degree_range() { return between(1, 1 << 16); }

class Args {
 public:
  Args(int argc, char** argv, std::string program_doc);
  // A value outside `r` (or not a number, or not finite) is a config_error naming the flag, the
  // range and the value, whether it came from the command line or from --config.
  int get_int(const std::string& flag, int def, const std::string& help, Range r = {});
  long get_long(const std::string& flag, long def, const std::string& help, Range r = {});
  double get_double(const std::string& flag, double def, const std::string& help, Range r = {});
  std::string get_str(const std::string& flag, const std::string& def, const std::string& help);
  bool get_bool(const std::string& flag, const std::string& help);  // a switch: present = true
  bool has(const std::string& flag) const;
  bool declares(const std::string& flag) const;  // whether this binary reads the flag (so far)
  // Every flag read so far with the value this run uses (given or default; switches true/false),
  // as a --config file takes them: {"preset": "tiny", "lr-schedule": "cosine", "quiet": false, ...}.
  Json effective() const;
  void finish();  // --help prints and exits 0; unknown flags are a config_error
  // The --help heading of the flags declared from now on ("": the program's own, listed first);
  // returns the previous one. The shared flags are grouped: model, optimizer, data, run and
  // checkpoint, operations.
  std::string group(const std::string& heading);
 private:
  const char* take(const std::string& flag, const std::string& def, const std::string& help, bool is_switch);
  void load_config();
  std::string doc_;
  std::vector<std::pair<std::string, std::string>> args_;  // flag -> value, in order
  std::vector<bool> used_;
  std::vector<std::pair<std::string, std::string>> help_;  // heading, text
  std::string group_;
  std::vector<std::string> declared_;
  std::vector<std::pair<std::string, Json>> effective_;
  std::string config_;   // the --config file, "" without one
  size_t from_config_ = 0;  // args_[0, from_config_) came from it
  bool want_help_ = false;
};

}  // namespace ts
