// json.h — a small JSON value: parse with positioned error messages, serialise compactly or
// indented. Used for safetensors headers, config.json, trainer.json and --log-json lines.
//
// Objects keep insertion order, so files we write read back in the order a person expects.
// Numbers keep an int64 alongside the double when the literal is integral, so step counts and
// byte offsets above 2^53 survive a round trip.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace ts {

// A malformed file or value. Readers throw it internally and the public entry points turn it
// into config_error(), so tests can check the message without the process exiting.
struct FormatError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class Json {
 public:
  enum class Type : uint8_t { Null, Bool, Number, String, Array, Object };
  using Member = std::pair<std::string, Json>;

  Json() = default;
  Json(std::nullptr_t) {}
  Json(bool v) : type_(Type::Bool), b_(v) {}
  template <class T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool>, int> = 0>
  Json(T v) : type_(Type::Number), d_(double(v)) {
    // An unsigned value beyond int64 keeps only its double.
    is_int_ = std::is_signed_v<T> || uint64_t(v) <= uint64_t(INT64_MAX);
    if (is_int_) i_ = int64_t(v);
  }
  template <class T, std::enable_if_t<std::is_floating_point_v<T>, int> = 0>
  Json(T v) : type_(Type::Number), d_(double(v)) {}
  Json(const char* s) : type_(Type::String), s_(s) {}
  Json(std::string s) : type_(Type::String), s_(std::move(s)) {}
  static Json array(std::vector<Json> items = {});
  static Json object();

  Type type() const { return type_; }
  bool is_null() const { return type_ == Type::Null; }
  bool is_bool() const { return type_ == Type::Bool; }
  bool is_number() const { return type_ == Type::Number; }
  bool is_int() const { return type_ == Type::Number && is_int_; }  // an integral literal
  bool is_string() const { return type_ == Type::String; }
  bool is_array() const { return type_ == Type::Array; }
  bool is_object() const { return type_ == Type::Object; }
  static const char* type_name(Type t);

  // Typed access; the wrong type throws FormatError ("expected a string, got a number").
  bool as_bool() const;
  double as_double() const;
  int64_t as_int() const;  // also accepts a double with an exact int64 value
  const std::string& as_string() const;
  const std::vector<Json>& as_array() const;
  const std::vector<Member>& items() const;  // an object's members in insertion order

  size_t size() const;  // elements of an array or members of an object
  const Json& operator[](size_t i) const;
  void push_back(Json v);  // on an array (a null becomes one)
  // Finds or appends the member (a null becomes an object).
  Json& operator[](const std::string& key);
  const Json* find(const std::string& key) const;  // nullptr when absent
  const Json& at(const std::string& key) const;    // FormatError naming the key when absent
  bool contains(const std::string& key) const { return find(key) != nullptr; }

  // indent < 0: one line with no spaces (JSON lines); otherwise pretty-printed like Python's
  // json.dumps(indent=n). NaN and infinities have no JSON form and are written as null.
  std::string dump(int indent = -1) const;
  // The whole text must be one value (surrounding whitespace allowed). Errors are FormatError
  // with "line L, column C: ..."; duplicate object keys are errors too.
  static Json parse(const std::string& text);

  // Structural equality; object member order matters, numbers compare by value.
  bool operator==(const Json& o) const;
  bool operator!=(const Json& o) const { return !(*this == o); }

 private:
  void expect(Type t) const;
  void dump_to(std::string& out, int indent, int depth) const;

  Type type_ = Type::Null;
  bool b_ = false;
  bool is_int_ = false;
  int64_t i_ = 0;
  double d_ = 0;
  std::string s_;
  std::vector<Json> arr_;
  std::vector<Member> obj_;
  friend class JsonParser;
};

// The double nearest the shortest decimal that reads back as `f`: 1e-5f is written 1e-05, not
// 9.999999747378752e-06 (what the float's exact value would print as).
double shortest_decimal(float f);

}  // namespace ts
