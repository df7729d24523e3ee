/* The two walks the request guard makes over every parsed body, in native code: its nesting depth and its shape.
 *
 * An agent's request (a conversation of tool calls, a list of tools with their JSON schemas) holds a hundred or
 * more arrays and objects. Walked in Python, the depth check (engine_guard.schemas) and the shape
 * (engine_guard.shapes) took ~170 µs of such a request, more than the rest of the gateway's work on it. Both are
 * pure functions of the parsed value; these are their Python definitions, line for line
 * (tests/engine_guard/test_native_walk.py holds the two to the same answers), and the Python ones serve where this
 * module is not built.
 *
 *   deeper_than(value, limit) -> bool   arrays/objects nested more than ``limit`` levels (the value itself: 1)
 *   describe(value, depth) -> str       engine_guard.shapes._describe
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* ---------------------------------------------------------------------------------------------- nesting depth */

/* Whether ``value`` (at nesting ``level``, counting itself) holds containers deeper than ``limit``. Recursion stops
 * at limit + 1 levels: the C stack holds at most that many frames, whatever the body. -1: a Python error. */
static int deeper(PyObject *value, int level, int limit) {
    if (PyDict_Check(value)) {
        if (level > limit) return 1;
        Py_ssize_t at = 0;
        PyObject *key, *child;
        while (PyDict_Next(value, &at, &key, &child)) {
            if (PyDict_Check(child) || PyList_Check(child)) {
                int found = deeper(child, level + 1, limit);
                if (found != 0) return found;
            }
        }
        return 0;
    }
    if (PyList_Check(value)) {
        if (level > limit) return 1;
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(value); i++) {
            PyObject *child = PyList_GET_ITEM(value, i);
            if (PyDict_Check(child) || PyList_Check(child)) {
                int found = deeper(child, level + 1, limit);
                if (found != 0) return found;
            }
        }
    }
    return 0;
}

static PyObject *deeper_than(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *value;
    int limit;
    if (!PyArg_ParseTuple(args, "Oi:deeper_than", &value, &limit)) return NULL;
    int found = deeper(value, 1, limit);
    if (found < 0) return NULL;
    return PyBool_FromLong(found);
}

/* ------------------------------------------------------------------------------------------------------ shape */

/* The descriptions that name a size class ("str0".."str64", "int0"..., "float0"...: float's 0 is its own, "list",
 * "obj") and the fixed ones, made once: most of a shape is these. */
#define CLASSES 65
static PyObject *str_class[CLASSES], *int_class[CLASSES], *float_class[CLASSES], *list_class[CLASSES], *obj_class[CLASSES];
static PyObject *text_true, *text_false, *text_null, *int_negative, *float_negative, *float_zero, *float_fraction;
static PyObject *empty, *comma, *colon, *open_brace, *close_brace, *open_bracket, *close_bracket;

static int make_texts(void) {
    for (int i = 0; i < CLASSES; i++) {
        if (!(str_class[i] = PyUnicode_FromFormat("str%d", i)) || !(int_class[i] = PyUnicode_FromFormat("int%d", i)) ||
            !(float_class[i] = PyUnicode_FromFormat("float%d", i)) || !(list_class[i] = PyUnicode_FromFormat("list%d", i)) ||
            !(obj_class[i] = PyUnicode_FromFormat("obj%d", i)))
            return -1;
    }
    return (text_true = PyUnicode_FromString("true")) && (text_false = PyUnicode_FromString("false")) &&
                   (text_null = PyUnicode_FromString("null")) && (int_negative = PyUnicode_FromString("int-")) &&
                   (float_negative = PyUnicode_FromString("float-")) && (float_zero = PyUnicode_FromString("float0")) &&
                   (float_fraction = PyUnicode_FromString("float<1")) && (empty = PyUnicode_FromString("")) &&
                   (comma = PyUnicode_FromString(",")) && (colon = PyUnicode_FromString(":")) &&
                   (open_brace = PyUnicode_FromString("{")) && (close_brace = PyUnicode_FromString("}")) &&
                   (open_bracket = PyUnicode_FromString("[")) && (close_bracket = PyUnicode_FromString("]"))
               ? 0
               : -1;
}

static PyObject *named(PyObject *text) {
    Py_INCREF(text);
    return text;
}

/* int.bit_length() of a non-negative int object. -1: a Python error. */
static Py_ssize_t bit_length(PyObject *number) {
    int overflow = 0;
    long long small = PyLong_AsLongLongAndOverflow(number, &overflow);
    if (small == -1 && PyErr_Occurred()) return -1;
    if (!overflow) return small == 0 ? 0 : 64 - __builtin_clzll((unsigned long long)small);
    PyObject *bits = PyObject_CallMethod(number, "bit_length", NULL);
    if (bits == NULL) return -1;
    Py_ssize_t out = PyLong_AsSsize_t(bits);
    Py_DECREF(bits);
    return out;
}

static Py_ssize_t size_class(Py_ssize_t length) { return length == 0 ? 0 : 64 - __builtin_clzll((unsigned long long)length); }

/* The description of a size class past the table (an int over 64 bits): built. */
static PyObject *sized(PyObject **table, const char *prefix, Py_ssize_t size) {
    return size < CLASSES ? named(table[size]) : PyUnicode_FromFormat("%s%zd", prefix, size);
}

static PyObject *describe_value(PyObject *value, long depth);

/* "[a,b]": the sorted distinct descriptions of a list's first 256 items, appended to ``pieces``. 0, or -1. */
static int describe_items(PyObject *list, long depth, PyObject *pieces) {
    PyObject *seen = PySet_New(NULL);
    if (seen == NULL) return -1;
    for (Py_ssize_t i = 0; i < 256 && i < PyList_GET_SIZE(list); i++) {
        PyObject *item = PyList_GET_ITEM(list, i);
        Py_INCREF(item);
        PyObject *text = describe_value(item, depth - 1);
        Py_DECREF(item);
        if (text == NULL || PySet_Add(seen, text) < 0) {
            Py_XDECREF(text);
            Py_DECREF(seen);
            return -1;
        }
        Py_DECREF(text);
    }
    PyObject *items = PySequence_List(seen);
    Py_DECREF(seen);
    if (items == NULL) return -1;
    int failed = PyList_Sort(items) < 0 || PyList_Append(pieces, open_bracket) < 0;
    for (Py_ssize_t i = 0; !failed && i < PyList_GET_SIZE(items); i++)
        failed = (i > 0 && PyList_Append(pieces, comma) < 0) || PyList_Append(pieces, PyList_GET_ITEM(items, i)) < 0;
    Py_DECREF(items);
    return failed || PyList_Append(pieces, close_bracket) < 0 ? -1 : 0;
}

/* "{key:description,...}" of a dict's first 64 keys, sorted, appended to ``pieces``. 0, or -1. */
static int describe_fields(PyObject *dict, long depth, PyObject *pieces) {
    PyObject *keys = PyDict_Keys(dict);
    if (keys == NULL) return -1;
    int failed = PyList_Sort(keys) < 0 || PyList_Append(pieces, open_brace) < 0;
    for (Py_ssize_t i = 0; !failed && i < 64 && i < PyList_GET_SIZE(keys); i++) {
        PyObject *key = PyList_GET_ITEM(keys, i);
        PyObject *child = PyDict_GetItemWithError(dict, key); /* borrowed */
        if (child == NULL) {
            if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, key);
            failed = 1;
            break;
        }
        PyObject *name = PyObject_Str(key); /* f"{key}" */
        Py_INCREF(child);
        PyObject *text = name == NULL ? NULL : describe_value(child, depth - 1);
        Py_DECREF(child);
        failed = text == NULL || (i > 0 && PyList_Append(pieces, comma) < 0) || PyList_Append(pieces, name) < 0 ||
                 PyList_Append(pieces, colon) < 0 || PyList_Append(pieces, text) < 0;
        Py_XDECREF(name);
        Py_XDECREF(text);
    }
    Py_DECREF(keys);
    return failed || PyList_Append(pieces, close_brace) < 0 ? -1 : 0;
}

/* A container's description: its pieces, joined once. */
static PyObject *describe_container(PyObject *value, long depth) {
    PyObject *pieces = PyList_New(0);
    if (pieces == NULL) return NULL;
    int failed;
    if (Py_EnterRecursiveCall(" while describing a request's shape")) {
        Py_DECREF(pieces);
        return NULL;
    }
    if (PyList_Check(value)) {
        PyObject *head = sized(list_class, "list", size_class(PyList_GET_SIZE(value)));
        failed = head == NULL || PyList_Append(pieces, head) < 0 || describe_items(value, depth, pieces) < 0;
        Py_XDECREF(head);
    } else {
        failed = describe_fields(value, depth, pieces) < 0;
    }
    Py_LeaveRecursiveCall();
    PyObject *out = failed ? NULL : PyUnicode_Join(empty, pieces);
    Py_DECREF(pieces);
    return out;
}

static PyObject *describe_value(PyObject *value, long depth) {
    if (PyBool_Check(value)) return named(value == Py_True ? text_true : text_false);
    if (PyLong_Check(value)) {
        int overflow = 0;
        long long small = PyLong_AsLongLongAndOverflow(value, &overflow);
        if (small == -1 && PyErr_Occurred()) return NULL;
        if (overflow < 0 || (!overflow && small < 0)) return named(int_negative);
        Py_ssize_t bits = bit_length(value);
        return bits < 0 ? NULL : sized(int_class, "int", bits);
    }
    if (PyFloat_Check(value)) {
        double number = PyFloat_AS_DOUBLE(value);
        if (number < 0) return named(float_negative);
        if (number == 0) return named(float_zero);
        if (number < 1) return named(float_fraction);
        PyObject *whole = PyNumber_Long(value); /* nan, inf: the same error as int(value) */
        if (whole == NULL) return NULL;
        Py_ssize_t bits = bit_length(whole);
        Py_DECREF(whole);
        return bits < 0 ? NULL : sized(float_class, "float", bits);
    }
    if (PyUnicode_Check(value)) return named(str_class[size_class(PyUnicode_GET_LENGTH(value))]);
    if (value == Py_None) return named(text_null);
    if (PyList_Check(value)) {
        if (depth <= 0) return named(list_class[size_class(PyList_GET_SIZE(value))]);
        return describe_container(value, depth);
    }
    if (PyDict_Check(value)) {
        if (depth <= 0) return named(obj_class[size_class(PyDict_GET_SIZE(value))]);
        return describe_container(value, depth);
    }
    return PyType_GetName(Py_TYPE(value)); /* type(value).__name__ */
}

static PyObject *describe(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *value;
    long depth;
    if (!PyArg_ParseTuple(args, "Ol:describe", &value, &depth)) return NULL;
    return describe_value(value, depth);
}

static PyMethodDef module_methods[] = {
    {"deeper_than", deeper_than, METH_VARARGS, "Whether arrays/objects in value nest more than limit levels."},
    {"describe", describe, METH_VARARGS, "engine_guard.shapes._describe(value, depth), in native code."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_walk", NULL, -1, module_methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__walk(void) { return make_texts() < 0 ? NULL : PyModule_Create(&module); }
