// ranks: 1
// The file formats: JSON values, safetensors written in slices by several writers (as ranks do),
// a file laid out by hand exactly as Python's safetensors writes it, and corrupt files.
#include <catch2/catch.hpp>
#include <stdlib.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "tensor/core.h"
#include "tensor/device.h"
#include "test_util.h"
#include "formats/json.h"
#include "formats/safetensors.h"

using namespace ts;
using tst::TempDir;
using tst::write_bytes;
using Catch::Matchers::Contains;

namespace {

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// The message of the FormatError that opening `path` throws ("" when it opens).
std::string open_error(const std::string& path) {
  try {
    SafetensorsReader::open_or_throw(path);
  } catch (const FormatError& e) {
    return e.what();
  }
  return "";
}

std::string parse_error(const std::string& text) {
  try {
    Json::parse(text);
  } catch (const FormatError& e) {
    return e.what();
  }
  return "";
}

// A safetensors file from a header JSON and raw data, as the format defines it.
std::string st_file(const std::string& header_json, const std::string& data) {
  uint64_t n = header_json.size();
  std::string out(8, '\0');
  memcpy(&out[0], &n, 8);
  return out + header_json + data;
}

template <class T> std::string as_bytes(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

}  // namespace

// ----- JSON ----------------------------------------------------------------------------------------

TEST_CASE("json: values round trip through dump and parse", "[json]") {
  Json j = Json::object();
  j["name"] = "tinyscale";
  j["step"] = int64_t(1) << 60;
  j["lr"] = 3e-4;
  j["ratio"] = 2.0;
  j["neg"] = -17;
  j["ok"] = true;
  j["none"] = nullptr;
  j["text"] = std::string("quote\" back\\ nl\n tab\t ctl\x01 é 😀");
  j["list"] = Json::array({1, 2.5, "x", Json::array(), Json::object()});
  j["nested"]["deeper"]["k"] = 7;
  for (int indent : {-1, 2}) {
    std::string s = j.dump(indent);
    Json back = Json::parse(s);
    CHECK(back == j);
    CHECK(back.dump(indent) == s);
  }
  CHECK(j.at("step").as_int() == (int64_t(1) << 60));
  CHECK(j.at("nested").at("deeper").at("k").as_int() == 7);
  CHECK(j.at("list")[2].as_string() == "x");
  CHECK(j.at("list").size() == 5);
}

TEST_CASE("json: objects keep insertion order", "[json]") {
  Json j;
  j["zeta"] = 1;
  j["alpha"] = 2;
  j["mid"] = 3;
  j["alpha"] = 4;  // assignment keeps the original position
  CHECK(j.dump() == R"({"zeta":1,"alpha":4,"mid":3})");
  Json p = Json::parse(R"({"b": 1, "a": 2, "c": 3})");
  std::vector<std::string> keys;
  for (auto& m : p.items()) keys.push_back(m.first);
  CHECK(keys == std::vector<std::string>{"b", "a", "c"});
}

TEST_CASE("json: numbers keep int64 when integral and round trip doubles exactly", "[json]") {
  CHECK(Json::parse("9223372036854775807").as_int() == INT64_MAX);
  CHECK(Json::parse("-9223372036854775808").as_int() == INT64_MIN);
  CHECK(Json::parse("12345678901234567").as_int() == 12345678901234567LL);  // not a double
  CHECK(Json::parse("12345678901234567").is_int());
  CHECK_FALSE(Json::parse("9223372036854775808").is_int());  // beyond int64: a double
  CHECK_FALSE(Json::parse("1e3").is_int());
  CHECK(Json::parse("1e3").as_int() == 1000);  // an exactly integral double converts
  CHECK(Json::parse("-0").as_int() == 0);
  CHECK(Json::parse("1.5e-3").as_double() == 1.5e-3);
  CHECK_THROWS_WITH(Json::parse("1.5").as_int(), Contains("expected an integer"));
  CHECK(Json(2.0).dump() == "2.0");
  CHECK(Json(0.1).dump() == "0.1");
  CHECK(Json(-0.0).dump() == "-0.0");
  CHECK(Json(1e300).dump() == "1e+300");
  CHECK(Json(NAN).dump() == "null");
  CHECK(Json(uint64_t(1) << 63).dump() == "9.223372036854776e+18");
  std::mt19937_64 gen(7);
  for (int k = 0; k < 2000; k++) {
    double d;
    uint64_t bits = gen();
    memcpy(&d, &bits, 8);
    if (!std::isfinite(d)) continue;
    double back = Json::parse(Json(d).dump()).as_double();
    CHECK(memcmp(&back, &d, 8) == 0);
  }
}

TEST_CASE("json: string escapes including \\u and surrogate pairs", "[json]") {
  CHECK(Json::parse(R"("\"\\\/\b\f\n\r\t")").as_string() == "\"\\/\b\f\n\r\t");
  CHECK(Json::parse(R"("\u00e9\u20AC")").as_string() == "\xc3\xa9\xe2\x82\xac");
  CHECK(Json::parse(R"("\ud83d\ude00")").as_string() == "\xf0\x9f\x98\x80");
  CHECK(Json::parse(R"("\u0000")").as_string() == std::string(1, '\0'));
  CHECK(Json::parse("\"caf\xc3\xa9\"").as_string() == "caf\xc3\xa9");  // raw UTF-8
  CHECK(Json(std::string("a\x01" "b\x1f")).dump() == R"("a\u0001b\u001f")");
  CHECK(Json(std::string(1, '\0')).dump() == R"("\u0000")");
}

TEST_CASE("json: pretty printing matches Python's json.dumps(indent=2)", "[json]") {
  Json j;
  j["a"] = Json::array({1, 2});
  j["b"] = Json::object();
  j["c"] = Json::array();
  j["d"]["e"] = "f";
  CHECK(j.dump(2) == "{\n  \"a\": [\n    1,\n    2\n  ],\n  \"b\": {},\n  \"c\": [],\n  \"d\": {\n    \"e\": \"f\"\n  }\n}");
  CHECK(j.dump() == R"({"a":[1,2],"b":{},"c":[],"d":{"e":"f"}})");
}

TEST_CASE("json: parse errors say what and where", "[json]") {
  CHECK_THAT(parse_error(""), Contains("line 1, column 1: unexpected end of input, expected a value"));
  CHECK_THAT(parse_error("   "), Contains("unexpected end of input"));
  CHECK_THAT(parse_error(R"({"a":1,})"), Contains("column 8: expected a string key"));
  CHECK_THAT(parse_error("[1 2]"), Contains("column 4: expected ',' or ']', got '2'"));
  CHECK_THAT(parse_error("[1,"), Contains("unexpected end of input"));
  CHECK_THAT(parse_error(R"({"a" 1})"), Contains("expected ':'"));
  CHECK_THAT(parse_error("01"), Contains("leading zeros"));
  CHECK_THAT(parse_error("1."), Contains("expected a digit after '.'"));
  CHECK_THAT(parse_error("1e"), Contains("exponent"));
  CHECK_THAT(parse_error("-"), Contains("expected a digit"));
  CHECK_THAT(parse_error("+1"), Contains("unexpected '+'"));
  CHECK_THAT(parse_error(R"("abc)"), Contains("unterminated string"));
  CHECK_THAT(parse_error(R"("\x")"), Contains("invalid escape '\\x'"));
  CHECK_THAT(parse_error(R"("\u12g4")"), Contains("invalid hex digit 'g'"));
  CHECK_THAT(parse_error(R"("\ud800")"), Contains("high surrogate not followed by a low surrogate"));
  CHECK_THAT(parse_error(R"("\udc00")"), Contains("unpaired low surrogate"));
  CHECK_THAT(parse_error("\"a\nb\""), Contains("control character"));
  CHECK_THAT(parse_error(R"({"a":1,"a":2})"), Contains("column 8: duplicate key \"a\""));
  CHECK_THAT(parse_error("tru"), Contains("invalid literal"));
  CHECK_THAT(parse_error("nul"), Contains("invalid literal"));
  CHECK_THAT(parse_error("1 2"), Contains("column 3: unexpected '2' after the value"));
  CHECK_THAT(parse_error("{\n  \"a\": 1,\n  \"b\": ?\n}"), Contains("line 3, column 8: unexpected '?'"));
  CHECK_THAT(parse_error(std::string(1000, '[')), Contains("nesting deeper than"));
  CHECK_THAT(parse_error("{'a':1}"), Contains("expected a string key"));
}

TEST_CASE("json: typed access reports the mismatch", "[json]") {
  Json j = Json::parse(R"({"n": 1, "s": "x", "a": [1]})");
  CHECK_THROWS_WITH(j.at("missing"), Contains("missing key \"missing\""));
  CHECK_THROWS_WITH(j.at("n").as_string(), Contains("expected a string, got a number"));
  CHECK_THROWS_WITH(j.at("s").as_double(), Contains("expected a number, got a string"));
  CHECK_THROWS_WITH(j.at("a")[3], Contains("index 3 out of range"));
  CHECK_THROWS_WITH(j.at("a").at("k"), Contains("expected an object, got an array"));
  CHECK(j.find("nope") == nullptr);
  CHECK(j.contains("s"));
}

// ----- safetensors -----------------------------------------------------------------------------------

namespace {

struct Table {
  std::vector<StEntry> entries = {
      {"model.layers.0.mlp.up_proj.weight", "F32", {6, 5}},
      {"model.norm.weight", "BF16", {7}},  // odd length: the next tensor would be misaligned
      {"step_counts", "I32", {3, 3}},
      {"empty", "F32", {0, 4}},
      {"lm_head.weight", "BF16", {4, 3}},
  };
  std::map<std::string, std::string> meta = {{"format", "pt"}, {"note", "slices"}};
  std::map<std::string, std::vector<float>> values;
  Table() {
    std::mt19937 gen(3);
    std::normal_distribution<float> nd;
    for (auto& e : entries) {
      auto& v = values[e.name];
      v.resize(size_t(e.numel()));
      for (auto& x : v) x = e.dtype == "I32" ? float(int(gen() % 2001) - 1000) : nd(gen);
    }
  }
};

}  // namespace

TEST_CASE("safetensors: slices from several writers equal the whole tensors written at once", "[safetensors]") {
  TempDir dir;
  Table t;
  std::string whole = dir.file("whole.safetensors"), sliced = dir.file("sliced.safetensors");
  {
    SafetensorsWriter w(whole, t.entries, t.meta, true);
    for (auto& e : t.entries) w.write(e.name, 0, t.values[e.name].data(), e.numel());
    w.sync_and_close();
  }
  // Creator writes the header only; three "ranks" then each write uneven, interleaved slices.
  SafetensorsWriter(sliced, t.entries, t.meta, true).sync_and_close();
  for (int rank = 0; rank < 3; rank++) {
    SafetensorsWriter w(sliced, t.entries, t.meta, false);
    for (auto& e : t.entries) {
      int64_t n = e.numel(), cut1 = n / 5, cut2 = n / 2;
      int64_t lo = rank == 0 ? 0 : rank == 1 ? cut1 : cut2, hi = rank == 0 ? cut1 : rank == 1 ? cut2 : n;
      w.write(e.name, lo, t.values[e.name].data() + lo, hi - lo);
    }
    w.sync_and_close();
  }
  REQUIRE(read_bytes(whole) == read_bytes(sliced));

  SafetensorsReader r = SafetensorsReader::open_or_throw(sliced);
  CHECK(r.metadata() == t.meta);
  std::vector<std::string> names;
  for (auto& e : t.entries) names.push_back(e.name);
  CHECK(r.names() == names);
  for (auto& e : t.entries) {
    CHECK(r.entry(e.name).dtype == e.dtype);
    CHECK(r.entry(e.name).shape == e.shape);
    std::vector<float> got(size_t(e.numel()), -1.f);
    r.read(e.name, 0, got.data(), e.numel());
    for (int64_t k = 0; k < e.numel(); k++) {
      float want = t.values[e.name][size_t(k)];
      if (e.dtype == "BF16") want = bf16_to_float(float_to_bf16(want));
      CHECK(got[size_t(k)] == want);
    }
  }
  // A partial read at an offset, and raw I32 bytes.
  std::vector<float> part(4);
  r.read("model.layers.0.mlp.up_proj.weight", 11, part.data(), 4);
  for (int k = 0; k < 4; k++) CHECK(part[size_t(k)] == t.values["model.layers.0.mlp.up_proj.weight"][size_t(11 + k)]);
  std::vector<int32_t> ints(9);
  r.read_raw("step_counts", 0, ints.data(), 9);
  for (int k = 0; k < 9; k++) CHECK(float(ints[size_t(k)]) == t.values["step_counts"][size_t(k)]);
}

TEST_CASE("safetensors: the header follows the format's layout rules", "[safetensors]") {
  Table t;
  std::string h = SafetensorsWriter::header_bytes(t.entries, t.meta);
  uint64_t n;
  memcpy(&n, h.data(), 8);
  CHECK(n == h.size() - 8);
  CHECK(n % 8 == 0);
  Json j = Json::parse(h.substr(8));
  CHECK(j.items().front().first == "__metadata__");
  CHECK(j.at("__metadata__").at("format").as_string() == "pt");
  // 4-byte tensors first, then 2-byte ones: every tensor is aligned to its element size.
  auto off = [&](const std::string& name, int k) { return j.at(name).at("data_offsets")[size_t(k)].as_int(); };
  CHECK(off("model.layers.0.mlp.up_proj.weight", 0) == 0);
  CHECK(off("step_counts", 0) == 120);
  CHECK(off("empty", 0) == 156);
  CHECK(off("empty", 1) == 156);
  CHECK(off("model.norm.weight", 0) == 156);
  CHECK(off("lm_head.weight", 0) == 170);
  CHECK(off("lm_head.weight", 1) == 194);
  CHECK(j.at("step_counts").at("shape").dump() == "[3,3]");
}

TEST_CASE("safetensors: bf16 rounds to nearest even", "[safetensors]") {
  TempDir dir;
  std::string p = dir.file("r.safetensors");
  std::vector<uint32_t> bits = {0x3f808000u, 0x3f818000u, 0x3f808001u, 0x3f807fffu};
  std::vector<float> vals(bits.size());
  memcpy(vals.data(), bits.data(), 16);
  std::vector<StEntry> e = {{"x", "BF16", {4}}};
  SafetensorsWriter w(p, e, {}, true);
  w.write("x", 0, vals.data(), 4);
  w.sync_and_close();
  std::vector<uint16_t> raw(4);
  SafetensorsReader::open_or_throw(p).read_raw("x", 0, raw.data(), 4);
  CHECK(raw == std::vector<uint16_t>{0x3f80, 0x3f82, 0x3f81, 0x3f80});
}

TEST_CASE("safetensors: reads a file laid out as Python's safetensors writes it", "[safetensors]") {
  // safetensors.torch.save_file({"weight": f32 [2, 2], "bias": bf16 [3]}, metadata={"format": "pt"}):
  // the header lists tensors by name, 4-byte dtypes first in the data, padded with spaces.
  std::string header =
      R"({"__metadata__":{"format":"pt"},"bias":{"dtype":"BF16","shape":[3],"data_offsets":[16,22]},)"
      R"("weight":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})";
  header.append((8 - header.size() % 8) % 8, ' ');
  std::vector<float> weight = {1.5f, -2.25f, 3.0f, 1e-3f};
  std::vector<uint16_t> bias = {0x3f80, 0xc000, 0x3e80};  // 1, -2, 0.25
  TempDir dir;
  std::string p = dir.file("py.safetensors");
  write_bytes(p, st_file(header, as_bytes(weight) + as_bytes(bias)));

  SafetensorsReader r = SafetensorsReader::open_or_throw(p);
  CHECK(r.names() == std::vector<std::string>{"bias", "weight"});
  CHECK(r.metadata().at("format") == "pt");
  CHECK(r.has("weight"));
  CHECK_FALSE(r.has("missing"));
  CHECK(r.entry("weight").shape == std::vector<int64_t>{2, 2});
  std::vector<float> w(4), b(3);
  r.read("weight", 0, w.data(), 4);
  r.read("bias", 0, b.data(), 3);
  CHECK(w == weight);
  CHECK(b == std::vector<float>{1.f, -2.f, 0.25f});

  // Unpadded headers, unknown extra fields and other dtypes are valid too.
  std::string h2 = R"({"ids":{"dtype":"I64","shape":[2],"data_offsets":[0,16],"extra":1}})";
  std::vector<int64_t> ids = {5, -6};
  write_bytes(p, st_file(h2, as_bytes(ids)));
  SafetensorsReader r2 = SafetensorsReader::open_or_throw(p);
  std::vector<int64_t> got(2);
  r2.read_raw("ids", 0, got.data(), 2);
  CHECK(got == ids);
  CHECK(r2.metadata().empty());
}

TEST_CASE("safetensors: corrupt files give errors that name the file and the problem", "[safetensors]") {
  TempDir dir;
  std::string p = dir.file("bad.safetensors");
  std::string ok_header = R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})";
  std::string data(16, '\0');
  auto check = [&](const std::string& bytes, const std::string& expect) {
    write_bytes(p, bytes);
    std::string msg = open_error(p);
    CHECK_THAT(msg, Contains(p + ": "));
    CHECK_THAT(msg, Contains(expect));
  };
  CHECK(open_error(dir.file("absent.safetensors")) == dir.file("absent.safetensors") + ": No such file or directory");
  CHECK_THAT(open_error(dir.path), Contains("not a regular file"));
  check("abc", "only 3 bytes, too short for the 8-byte header length");
  check(st_file(ok_header, data).substr(0, 20), "header length 55 runs past the end of the file (20 bytes)");
  check(st_file(ok_header, data.substr(0, 10)), "tensor 'w': data ends at byte 16 but only 10 bytes of data follow the header (file truncated?)");
  check(st_file(R"({"w":{"dtype":"F32",})", ""), "header: JSON error at line 1, column 21: expected a string key");
  check(st_file("[1,2]", ""), "header: expected a JSON object");
  check(st_file(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,8]}})", data.substr(0, 8)),
        "tensor 'w': data_offsets [0, 8] hold 8 bytes but F32 [4] needs 16");
  check(st_file(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[16,32]}})", data + data),
        "tensor 'w' starts at data byte 16 where 0 was expected");
  check(st_file(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"v":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})", data),
        "packed without gaps or overlaps");
  check(st_file(ok_header, data + "xx"), "2 bytes of data after the last tensor");
  check(st_file(R"({"w":{"dtype":"F33","shape":[4],"data_offsets":[0,16]}})", data), "tensor 'w': unknown dtype 'F33'");
  check(st_file(R"({"w":{"dtype":"F32","data_offsets":[0,16]}})", data), "tensor 'w': missing key \"shape\"");
  check(st_file(R"({"w":{"dtype":"F32","shape":[-4],"data_offsets":[0,16]}})", data), "negative dimension");
  check(st_file(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[16,0]}})", data), "invalid data_offsets [16, 0]");
  check(st_file(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0]}})", data), "data_offsets must be [begin, end]");
  check(st_file(R"({"w":{"dtype":"F32","shape":[4.5],"data_offsets":[0,16]}})", data), "expected an integer");
  check(st_file(R"({"__metadata__":{"a":1},"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", data),
        "__metadata__ value for 'a' is not a string");
  check(st_file(R"({"w":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,16]}})", data), "is too large");
  std::string huge(8, '\0');
  uint64_t n = uint64_t(1) << 62;
  memcpy(&huge[0], &n, 8);
  check(huge + ok_header, "runs past the end of the file");
}

// ----- file helpers --------------------------------------------------------------------------------

TEST_CASE("file helpers: synced writes read back; unreadable files are named", "[files]") {
  TempDir dir;
  std::string p = dir.file("trainer.json");
  std::string text = Json::parse(R"({"step": 10, "mesh": {"dp": 2}})").dump(2) + "\n";
  write_text_file_synced(p, text);
  fsync_dir(dir.path);
  CHECK(read_text_file(p) == text);
  CHECK(read_file_or_throw(p) == text);
  write_text_file_synced(p, "");  // truncates
  CHECK(read_text_file(p).empty());
  CHECK_THROWS_WITH(read_file_or_throw(dir.file("nope.json")), dir.file("nope.json") + ": No such file or directory");
  CHECK_THROWS_WITH(read_file_or_throw(dir.path), Contains("not a regular file"));
}
