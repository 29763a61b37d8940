// flags.cu — typed flags with ranges, --config files, typo suggestions and grouped --help.
#include "training/flags.h"

#include "tensor/core.h"
#include "formats/json.h"
#include "formats/safetensors.h"
#include "comm/comm.h"
#include "comm/watchdog.h"

#include <algorithm>
#include <cmath>
#include <climits>
#include <cstdio>

namespace ts {

Args::Args(int argc, char** argv, std::string doc) : doc_(std::move(doc)) {
  for (int i = 1; i < argc; i++) {
    std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      want_help_ = true;
      continue;
    }
    if (a.rfind("--", 0) != 0) config_error("unexpected argument '%s' (flags start with --; see --help)", a.c_str());
    std::string v;
    size_t eq = a.find('=');
    if (eq != std::string::npos) {
      v = a.substr(eq + 1);
      a = a.substr(0, eq);
    } else if (i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0) {
      v = argv[++i];
    } else {
      v = "\x01";  // a switch with no value
    }
    args_.push_back({a, v});
  }
  load_config();
  used_.assign(args_.size(), false);
  group_ = "run and checkpoint";
  get_str("--config", "", "JSON file of flags ({\"steps\": 100, \"lr-schedule\": \"cosine\"}, _ or -), or a checkpoint's "
          "trainer.json; flags on the command line override it");
  group_ = "";
}

// --config FILE: its flags go before the command line's, so that the command line wins (the last
// occurrence of a flag does). A checkpoint's trainer.json holds them under "flags".
void Args::load_config() {
  for (auto& [flag, value] : args_)
    if (flag == "--config") config_ = value;
  if (config_.empty() || config_ == "\x01") return;
  Json j;
  try {
    j = Json::parse(read_text_file(config_));
    if (j.is_object() && j.contains("flags")) j = j.at("flags");
    if (!j.is_object()) throw FormatError("expected an object of flags");
  } catch (const FormatError& e) {
    config_error("--config %s: %s", config_.c_str(), e.what());
  }
  std::vector<std::pair<std::string, std::string>> from;
  for (auto& [key, v] : j.items()) {
    std::string flag = "--" + key;
    std::replace(flag.begin(), flag.end(), '_', '-');
    if (flag == "--config") continue;
    if (v.is_bool()) {
      if (v.as_bool()) from.push_back({flag, "\x01"});
    } else if (v.is_string()) {
      from.push_back({flag, v.as_string()});
    } else if (v.is_number()) {
      // JSON's 1e400 parses to inf, which dump() writes as null: the flag's parser names it instead.
      const double d = v.as_double();
      from.push_back({flag, std::isfinite(d) ? v.dump() : d > 0 ? "inf" : "-inf"});
    } else {
      config_error("--config %s: \"%s\" must be a string, a number or true/false", config_.c_str(), key.c_str());
    }
  }
  from_config_ = from.size();
  args_.insert(args_.begin(), from.begin(), from.end());
}

Json Args::effective() const {
  Json j = Json::object();
  for (auto& [flag, v] : effective_)
    if (flag != "--config") j[flag.substr(2)] = v;
  return j;
}

const char* Args::take(const std::string& flag, const std::string& def, const std::string& help, bool sw) {
  help_.push_back({group_, "  " + flag + (sw ? "" : " <" + def + ">") + "\n      " + help});
  declared_.push_back(flag);
  const char* found = nullptr;
  for (size_t i = 0; i < args_.size(); i++)
    if (args_[i].first == flag) {
      used_[i] = true;
      found = args_[i].second.c_str();  // the last occurrence wins
    }
  if (found && !sw && std::string(found) == "\x01") config_error("%s needs a value", flag.c_str());
  if (sw) effective_.push_back({flag, Json(found != nullptr)});
  else effective_.push_back({flag, Json(found ? std::string(found) : def == "\"\"" ? std::string() : def)});
  return found;
}

bool Args::has(const std::string& flag) const {
  for (auto& a : args_)
    if (a.first == flag) return true;
  return false;
}

bool Args::declares(const std::string& flag) const {
  return std::find(declared_.begin(), declared_.end(), flag) != declared_.end();
}

// " in [1, 2147483647]", " in (0, inf)": a range as the messages show it, "" for any number.
static std::string range_text(long double lo, long double hi, const Range& r, bool integer) {
  if (std::isinf(lo) && std::isinf(hi)) return "";
  auto num = [integer](long double v) {
    char b[48];
    if (std::isinf(v)) snprintf(b, sizeof b, "%sinf", v < 0 ? "-" : "");
    else if (integer) snprintf(b, sizeof b, "%.0Lf", v);
    else snprintf(b, sizeof b, "%.10Lg", v);
    return std::string(b);
  };
  const bool lo_open = r.lo_open || std::isinf(lo), hi_open = r.hi_open || std::isinf(hi);  // no number is inf
  return std::string(lo_open ? " in (" : " in [") + num(lo) + ", " + num(hi) + (hi_open ? ")" : "]");
}

// The one parser of numeric flags. Long double holds every 64-bit integer exactly, so a value one
// past a type's limit is refused instead of wrapping. [type_lo, type_hi]: what the type holds.
static long double parse_number(const std::string& flag, const char* s, const Range& r, bool integer,
                                long double type_lo, long double type_hi) {
  const long double lo = std::max<long double>(r.lo, type_lo), hi = std::min<long double>(r.hi, type_hi);
  char* end = nullptr;
  const long double v = strtold(s, &end);
  const bool number = end != s && *end == 0 && std::isfinite(double(v));  // 1e400 is a long double, not a double
  const bool whole = !integer || v == std::floor(v);
  const bool inside = (r.lo_open ? v > lo : v >= lo) && (r.hi_open ? v < hi : v <= hi);
  if (!number || !whole || !inside)
    config_error("%s expects %s%s, got '%s'", flag.c_str(), integer ? "an integer" : "a finite number",
                 range_text(lo, hi, r, integer).c_str(), s);
  return v;
}

long Args::get_long(const std::string& flag, long def, const std::string& help, Range r) {
  const char* v = take(flag, std::to_string(def), help, false);
  return v ? long(parse_number(flag, v, r, true, LONG_MIN, LONG_MAX)) : def;
}
int Args::get_int(const std::string& flag, int def, const std::string& help, Range r) {
  const char* v = take(flag, std::to_string(def), help, false);
  return v ? int(parse_number(flag, v, r, true, INT_MIN, INT_MAX)) : def;
}
double Args::get_double(const std::string& flag, double def, const std::string& help, Range r) {
  char buf[32];
  snprintf(buf, sizeof buf, "%g", def);
  const char* v = take(flag, buf, help, false);
  return v ? double(parse_number(flag, v, r, false, -HUGE_VALL, HUGE_VALL)) : def;
}
std::string Args::get_str(const std::string& flag, const std::string& def, const std::string& help) {
  const char* v = take(flag, def.empty() ? "\"\"" : def, help, false);
  return v ? std::string(v) : def;
}
bool Args::get_bool(const std::string& flag, const std::string& help) {
  const char* v = take(flag, "", help, true);
  if (v && std::string(v) != "\x01") config_error("%s is a switch and takes no value (got '%s')", flag.c_str(), v);
  return v != nullptr;
}

// Edits (insert, delete or replace one character) that turn a into b: Levenshtein's distance.
static size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); j++) row[j] = j;
  for (size_t i = 1; i <= a.size(); i++) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); j++) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] != b[j - 1])});
      diag = up;
    }
  }
  return row[b.size()];
}

// "; did you mean --steps?" when one declared flag is within a few edits of a typo, else "".
static std::string nearest_flag(const std::string& typo, const std::vector<std::string>& declared) {
  std::string best;
  size_t best_d = std::max<size_t>(2, typo.size() / 4) + 1;  // farther than this is another word
  for (const std::string& f : declared)
    if (size_t d = edit_distance(typo, f); d < best_d) best = f, best_d = d;
  return best.empty() ? "" : "; did you mean " + best + "?";
}

std::string Args::group(const std::string& heading) {
  std::string previous = group_;
  group_ = heading;
  return previous;
}

void Args::finish() {
  if (want_help_) {
    if (world_rank() == 0) {
      printf("%s\n\nflags:\n", doc_.c_str());
      // The program's own flags first, then the shared ones, group by group.
      std::vector<std::string> headings = {"", "model", "optimizer", "data", "run and checkpoint", "operations"};
      for (auto& h : help_)
        if (std::find(headings.begin(), headings.end(), h.first) == headings.end()) headings.push_back(h.first);
      for (const std::string& g : headings) {
        if (!g.empty()) printf("\n%s flags:\n", g.c_str());
        for (auto& h : help_)
          if (h.first == g) printf("%s\n", h.second.c_str());
      }
    }
    comm_finalize();
    exit(0);
  }
  for (size_t i = 0; i < args_.size(); i++)
    if (!used_[i])
      config_error("unknown flag %s%s%s (see --help)", args_[i].first.c_str(),
                   i < from_config_ ? (" in --config " + config_).c_str() : "",
                   nearest_flag(args_[i].first, declared_).c_str());
}

}  // namespace ts
