// json.cu — the JSON value, its parser (RFC 8259) and its serialiser.
#include "formats/json.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <unordered_set>

namespace ts {

// ----- the value ---------------------------------------------------------------------------------

Json Json::array(std::vector<Json> items) {
  Json j;
  j.type_ = Type::Array;
  j.arr_ = std::move(items);
  return j;
}

Json Json::object() {
  Json j;
  j.type_ = Type::Object;
  return j;
}

const char* Json::type_name(Type t) {
  switch (t) {
    case Type::Null: return "null";
    case Type::Bool: return "a boolean";
    case Type::Number: return "a number";
    case Type::String: return "a string";
    case Type::Array: return "an array";
    case Type::Object: return "an object";
  }
  return "?";
}

void Json::expect(Type t) const {
  if (type_ != t)
    throw FormatError(std::string("expected ") + type_name(t) + ", got " + type_name(type_));
}

bool Json::as_bool() const {
  expect(Type::Bool);
  return b_;
}

double Json::as_double() const {
  expect(Type::Number);
  return d_;
}

int64_t Json::as_int() const {
  expect(Type::Number);
  if (is_int_) return i_;
  // 2^63 is exactly representable; anything at or beyond it does not fit.
  if (d_ != std::floor(d_) || !(d_ >= -9223372036854775808.0 && d_ < 9223372036854775808.0))
    throw FormatError("expected an integer, got " + dump());
  return int64_t(d_);
}

const std::string& Json::as_string() const {
  expect(Type::String);
  return s_;
}

const std::vector<Json>& Json::as_array() const {
  expect(Type::Array);
  return arr_;
}

const std::vector<Json::Member>& Json::items() const {
  expect(Type::Object);
  return obj_;
}

size_t Json::size() const {
  if (type_ == Type::Object) return obj_.size();
  expect(Type::Array);
  return arr_.size();
}

const Json& Json::operator[](size_t i) const {
  expect(Type::Array);
  if (i >= arr_.size())
    throw FormatError("index " + std::to_string(i) + " out of range for an array of " +
                      std::to_string(arr_.size()));
  return arr_[i];
}

void Json::push_back(Json v) {
  if (type_ == Type::Null) type_ = Type::Array;
  expect(Type::Array);
  arr_.push_back(std::move(v));
}

Json& Json::operator[](const std::string& key) {
  if (type_ == Type::Null) type_ = Type::Object;
  expect(Type::Object);
  for (auto& m : obj_)
    if (m.first == key) return m.second;
  obj_.emplace_back(key, Json());
  return obj_.back().second;
}

const Json* Json::find(const std::string& key) const {
  expect(Type::Object);
  for (auto& m : obj_)
    if (m.first == key) return &m.second;
  return nullptr;
}

const Json& Json::at(const std::string& key) const {
  const Json* v = find(key);
  if (!v) throw FormatError("missing key \"" + key + "\"");
  return *v;
}

bool Json::operator==(const Json& o) const {
  if (type_ != o.type_) return false;
  switch (type_) {
    case Type::Null: return true;
    case Type::Bool: return b_ == o.b_;
    case Type::Number: return is_int_ && o.is_int_ ? i_ == o.i_ : d_ == o.d_;
    case Type::String: return s_ == o.s_;
    case Type::Array: return arr_ == o.arr_;
    case Type::Object: return obj_ == o.obj_;
  }
  return false;
}

// ----- serialising -------------------------------------------------------------------------------

static void dump_string(std::string& out, const std::string& s) {
  out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += char(c);  // UTF-8 passes through unescaped
        }
    }
  }
  out += '"';
}

// The shortest "%.Ng" that reads back to the same double, with ".0" added to integral values so
// that a double stays a double after a round trip (as Python's json does).
static void dump_double(std::string& out, double d) {
  if (!std::isfinite(d)) {
    out += "null";
    return;
  }
  char buf[40];
  for (int prec = 15; prec <= 17; prec++) {
    snprintf(buf, sizeof buf, "%.*g", prec, d);
    if (strtod(buf, nullptr) == d) break;
  }
  out += buf;
  if (std::string_view(buf).find_first_of(".en") == std::string_view::npos) out += ".0";
}

static void newline(std::string& out, int indent, int depth) {
  if (indent < 0) return;
  out += '\n';
  out.append(size_t(indent) * depth, ' ');
}

void Json::dump_to(std::string& out, int indent, int depth) const {
  switch (type_) {
    case Type::Null: out += "null"; return;
    case Type::Bool: out += b_ ? "true" : "false"; return;
    case Type::Number:
      if (is_int_) out += std::to_string(i_);
      else dump_double(out, d_);
      return;
    case Type::String: dump_string(out, s_); return;
    case Type::Array:
      out += '[';
      for (size_t k = 0; k < arr_.size(); k++) {
        if (k) out += ',';
        newline(out, indent, depth + 1);
        arr_[k].dump_to(out, indent, depth + 1);
      }
      if (!arr_.empty()) newline(out, indent, depth);
      out += ']';
      return;
    case Type::Object:
      out += '{';
      for (size_t k = 0; k < obj_.size(); k++) {
        if (k) out += ',';
        newline(out, indent, depth + 1);
        dump_string(out, obj_[k].first);
        out += indent < 0 ? ":" : ": ";
        obj_[k].second.dump_to(out, indent, depth + 1);
      }
      if (!obj_.empty()) newline(out, indent, depth);
      out += '}';
      return;
  }
}

std::string Json::dump(int indent) const {
  std::string out;
  dump_to(out, indent, 0);
  return out;
}

// ----- parsing -----------------------------------------------------------------------------------

class JsonParser {
 public:
  explicit JsonParser(const std::string& text) : t_(text) {}

  Json parse_document() {
    skip_ws();
    Json v = parse_value(0);
    skip_ws();
    if (p_ != t_.size()) fail("unexpected '" + show(t_[p_]) + "' after the value");
    return v;
  }

 private:
  // Deep nesting would overflow the stack; no file of ours nests more than a few levels.
  static constexpr int kMaxDepth = 256;

  [[noreturn]] void fail(const std::string& msg) const {
    size_t line = 1, col = 1;
    for (size_t k = 0; k < p_ && k < t_.size(); k++) {
      if (t_[k] == '\n') line++, col = 1;
      else col++;
    }
    throw FormatError("JSON error at line " + std::to_string(line) + ", column " +
                      std::to_string(col) + ": " + msg);
  }

  static std::string show(char c) {
    if (c >= 0x20 && c < 0x7f) return std::string(1, c);
    char buf[8];
    snprintf(buf, sizeof buf, "\\x%02x", (unsigned char)c);
    return buf;
  }

  bool at_end() const { return p_ >= t_.size(); }
  char peek() const { return at_end() ? '\0' : t_[p_]; }

  void skip_ws() {
    while (!at_end() && (t_[p_] == ' ' || t_[p_] == '\t' || t_[p_] == '\n' || t_[p_] == '\r')) p_++;
  }

  void expect_char(char c, const char* what) {
    if (at_end()) fail(std::string("unexpected end of input, expected ") + what);
    if (t_[p_] != c) fail(std::string("expected ") + what + ", got '" + show(t_[p_]) + "'");
    p_++;
  }

  void literal(const char* word) {
    size_t n = strlen(word);
    if (t_.compare(p_, n, word) != 0) fail("invalid literal");
    p_ += n;
  }

  Json parse_value(int depth) {
    if (at_end()) fail("unexpected end of input, expected a value");
    char c = t_[p_];
    switch (c) {
      case '{': return parse_object(depth + 1);
      case '[': return parse_array(depth + 1);
      case '"': return Json(parse_string());
      case 't': literal("true"); return Json(true);
      case 'f': literal("false"); return Json(false);
      case 'n': literal("null"); return Json();
      default:
        if (c == '-' || (c >= '0' && c <= '9')) return parse_number();
        fail("unexpected '" + show(c) + "', expected a value");
    }
  }

  Json parse_object(int depth) {
    if (depth > kMaxDepth) fail("nesting deeper than " + std::to_string(kMaxDepth));
    p_++;  // '{'
    Json obj = Json::object();
    std::unordered_set<std::string> seen;
    skip_ws();
    if (peek() == '}') {
      p_++;
      return obj;
    }
    while (true) {
      skip_ws();
      if (peek() != '"') fail(at_end() ? "unexpected end of input, expected a key" : "expected a string key");
      size_t key_pos = p_;
      std::string key = parse_string();
      if (!seen.insert(key).second) {
        p_ = key_pos;
        fail("duplicate key \"" + key + "\"");
      }
      skip_ws();
      expect_char(':', "':'");
      skip_ws();
      Json v = parse_value(depth);
      obj.obj_.emplace_back(std::move(key), std::move(v));
      skip_ws();
      if (peek() == ',') {
        p_++;
        continue;
      }
      expect_char('}', "',' or '}'");
      return obj;
    }
  }

  Json parse_array(int depth) {
    if (depth > kMaxDepth) fail("nesting deeper than " + std::to_string(kMaxDepth));
    p_++;  // '['
    Json arr = Json::array();
    skip_ws();
    if (peek() == ']') {
      p_++;
      return arr;
    }
    while (true) {
      skip_ws();
      arr.arr_.push_back(parse_value(depth));
      skip_ws();
      if (peek() == ',') {
        p_++;
        continue;
      }
      expect_char(']', "',' or ']'");
      return arr;
    }
  }

  unsigned hex4() {
    if (p_ + 4 > t_.size()) fail("unexpected end of input in a \\u escape");
    unsigned v = 0;
    for (int k = 0; k < 4; k++, p_++) {
      char c = t_[p_];
      v <<= 4;
      if (c >= '0' && c <= '9') v |= c - '0';
      else if (c >= 'a' && c <= 'f') v |= c - 'a' + 10;
      else if (c >= 'A' && c <= 'F') v |= c - 'A' + 10;
      else fail("invalid hex digit '" + show(c) + "' in a \\u escape");
    }
    return v;
  }

  static void append_utf8(std::string& s, unsigned cp) {
    if (cp < 0x80) {
      s += char(cp);
    } else if (cp < 0x800) {
      s += char(0xc0 | (cp >> 6));
      s += char(0x80 | (cp & 0x3f));
    } else if (cp < 0x10000) {
      s += char(0xe0 | (cp >> 12));
      s += char(0x80 | ((cp >> 6) & 0x3f));
      s += char(0x80 | (cp & 0x3f));
    } else {
      s += char(0xf0 | (cp >> 18));
      s += char(0x80 | ((cp >> 12) & 0x3f));
      s += char(0x80 | ((cp >> 6) & 0x3f));
      s += char(0x80 | (cp & 0x3f));
    }
  }

  // \uXXXX, joining a UTF-16 surrogate pair into one code point.
  unsigned unicode_escape() {
    size_t start = p_ - 2;
    unsigned cp = hex4();
    if (cp >= 0xdc00 && cp <= 0xdfff) {
      p_ = start;
      fail("unpaired low surrogate in a \\u escape");
    }
    if (cp >= 0xd800 && cp <= 0xdbff) {
      if (t_.compare(p_, 2, "\\u") != 0) {
        p_ = start;
        fail("high surrogate not followed by a low surrogate");
      }
      p_ += 2;
      unsigned lo = hex4();
      if (lo < 0xdc00 || lo > 0xdfff) {
        p_ = start;
        fail("high surrogate not followed by a low surrogate");
      }
      cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
    }
    return cp;
  }

  // The bytes of the well-formed UTF-8 sequence at p_ (RFC 3629: no overlong forms, no
  // surrogates, nothing past U+10FFFF); anything else fails, naming the byte.
  size_t utf8_length() const {
    const unsigned char b0 = (unsigned char)t_[p_];
    size_t n = b0 >= 0xc2 && b0 <= 0xdf ? 2 : b0 >= 0xe0 && b0 <= 0xef ? 3 : b0 >= 0xf0 && b0 <= 0xf4 ? 4 : 0;
    if (n == 0) fail("invalid UTF-8 byte " + show(char(b0)) + " in a string");
    // The second byte's range rules out overlong forms, surrogates and code points past U+10FFFF.
    const unsigned char lo = b0 == 0xe0 ? 0xa0 : b0 == 0xf0 ? 0x90 : 0x80;
    const unsigned char hi = b0 == 0xed ? 0x9f : b0 == 0xf4 ? 0x8f : 0xbf;
    for (size_t k = 1; k < n; k++) {
      const unsigned char b = p_ + k < t_.size() ? (unsigned char)t_[p_ + k] : 0;
      if (b < (k == 1 ? lo : 0x80) || b > (k == 1 ? hi : 0xbf))
        fail("invalid UTF-8 sequence starting with byte " + show(char(b0)) + " in a string");
    }
    return n;
  }

  std::string parse_string() {
    p_++;  // opening quote
    std::string s;
    while (true) {
      if (at_end()) fail("unterminated string");
      char c = t_[p_];
      if (c == '"') {
        p_++;
        return s;
      }
      if ((unsigned char)c < 0x20) fail("control character " + show(c) + " in a string (escape it)");
      if ((unsigned char)c >= 0x80) {
        const size_t n = utf8_length();
        s.append(t_, p_, n);
        p_ += n;
        continue;
      }
      if (c != '\\') {
        s += c;
        p_++;
        continue;
      }
      p_++;
      if (at_end()) fail("unterminated string");
      char e = t_[p_++];
      switch (e) {
        case '"': s += '"'; break;
        case '\\': s += '\\'; break;
        case '/': s += '/'; break;
        case 'b': s += '\b'; break;
        case 'f': s += '\f'; break;
        case 'n': s += '\n'; break;
        case 'r': s += '\r'; break;
        case 't': s += '\t'; break;
        case 'u': append_utf8(s, unicode_escape()); break;
        default: p_--; fail("invalid escape '\\" + show(e) + "'");
      }
    }
  }

  bool digit() const { return !at_end() && t_[p_] >= '0' && t_[p_] <= '9'; }

  // -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)? ; integral literals that fit keep an int64.
  Json parse_number() {
    size_t start = p_;
    if (peek() == '-') p_++;
    if (!digit()) fail("expected a digit");
    if (t_[p_] == '0') {
      p_++;
      if (digit()) fail("leading zeros are not allowed");
    } else {
      while (digit()) p_++;
    }
    bool integral = true;
    if (peek() == '.') {
      integral = false;
      p_++;
      if (!digit()) fail("expected a digit after '.'");
      while (digit()) p_++;
    }
    if (peek() == 'e' || peek() == 'E') {
      integral = false;
      p_++;
      if (peek() == '+' || peek() == '-') p_++;
      if (!digit()) fail("expected a digit in the exponent");
      while (digit()) p_++;
    }
    std::string lit = t_.substr(start, p_ - start);
    if (integral) {
      errno = 0;
      long long v = strtoll(lit.c_str(), nullptr, 10);
      if (errno != ERANGE) return Json(int64_t(v));
    }
    return Json(strtod(lit.c_str(), nullptr));  // out of range gives +-inf, as in Python
  }

  const std::string& t_;
  size_t p_ = 0;
};

Json Json::parse(const std::string& text) { return JsonParser(text).parse_document(); }

double shortest_decimal(float f) {
  char buf[32];
  for (int prec = 1; prec <= 9; prec++) {  // 9 significant digits always round-trip a float
    snprintf(buf, sizeof buf, "%.*g", prec, double(f));
    if (strtof(buf, nullptr) == f) break;
  }
  return strtod(buf, nullptr);
}

}  // namespace ts
