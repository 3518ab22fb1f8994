package chart

import (
	"fmt"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"

	"helm.sh/helm/v3/pkg/chart"
	"helm.sh/helm/v3/pkg/chartutil"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"

	"github.com/harvester-csi/harvester-csi-driver/tests/chart/render"
)

// valueSet is one way of installing the chart that the tests render.
type valueSet struct {
	name string // "default" or the ci/ file name
	file string // "" for default values
}

func valueSets(t *testing.T) []valueSet {
	t.Helper()
	sets := []valueSet{{name: "default"}}
	files, err := filepath.Glob(filepath.Join(render.ChartDir(), "ci", "*-values.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if len(files) < 2 {
		t.Fatalf("expected at least two ci/*-values.yaml files with non-default values, found %v", files)
	}
	for _, f := range files {
		sets = append(sets, valueSet{name: filepath.Base(f), file: f})
	}
	return sets
}

var (
	chartOnce sync.Once
	chartObj  *chart.Chart
	chartErr  error
)

func loadChart(t *testing.T) *chart.Chart {
	t.Helper()
	chartOnce.Do(func() { chartObj, chartErr = render.Load(render.ChartDir()) })
	if chartErr != nil {
		t.Fatalf("load chart: %v", chartErr)
	}
	return chartObj
}

// rendered is the chart rendered with one value set.
type rendered struct {
	vals    map[string]interface{} // the overrides
	eff     map[string]interface{} // the effective values (chart defaults merged)
	objects []*unstructured.Unstructured
}

func renderSet(t *testing.T, vs valueSet) *rendered {
	t.Helper()
	vals, err := render.ValuesFile(vs.file)
	if err != nil {
		t.Fatal(err)
	}
	return renderVals(t, vals)
}

func renderVals(t *testing.T, vals map[string]interface{}) *rendered {
	t.Helper()
	manifest, err := render.Template(loadChart(t), vals)
	if err != nil {
		t.Fatalf("render: %v", err)
	}
	objs, err := render.Objects(manifest)
	if err != nil {
		t.Fatal(err)
	}
	eff, err := chartutil.CoalesceValues(loadChart(t), vals)
	if err != nil {
		t.Fatal(err)
	}
	return &rendered{vals: vals, eff: eff.AsMap(), objects: objs}
}

func (r *rendered) find(kind, name string) *unstructured.Unstructured {
	for _, o := range r.objects {
		if o.GetKind() == kind && o.GetName() == name {
			return o
		}
	}
	return nil
}

func (r *rendered) must(t *testing.T, kind, name string) *unstructured.Unstructured {
	t.Helper()
	o := r.find(kind, name)
	if o == nil {
		t.Fatalf("no %s %q rendered; have %v", kind, name, r.names())
	}
	return o
}

func (r *rendered) ofKind(kind string) []*unstructured.Unstructured {
	var out []*unstructured.Unstructured
	for _, o := range r.objects {
		if o.GetKind() == kind {
			out = append(out, o)
		}
	}
	return out
}

func (r *rendered) names() []string {
	var out []string
	for _, o := range r.objects {
		out = append(out, o.GetKind()+"/"+o.GetName())
	}
	sort.Strings(out)
	return out
}

// typed converts an object into a Go API type (unknown fields are an error).
func typed[T any](t *testing.T, o *unstructured.Unstructured) *T {
	t.Helper()
	out := new(T)
	if err := fromUnstructuredStrict(o, out); err != nil {
		t.Fatalf("%s %s: %v", o.GetKind(), o.GetName(), err)
	}
	return out
}

// fromUnstructuredStrict fills target from o and fails on fields the Go type
// does not have (a misspelled or misplaced key in a template).
func fromUnstructuredStrict(o *unstructured.Unstructured, target interface{}) error {
	return runtime.DefaultUnstructuredConverter.FromUnstructuredWithValidation(o.Object, target, true)
}

// argValue returns the value of --name=value in args, and whether --name was
// present (with or without a value).
func argValue(args []string, name string) (string, bool) {
	for _, a := range args {
		if a == "--"+name {
			return "", true
		}
		if v, ok := strings.CutPrefix(a, "--"+name+"="); ok {
			return v, true
		}
	}
	return "", false
}

func flagNames(args []string) []string {
	var out []string
	for _, a := range args {
		if !strings.HasPrefix(a, "--") {
			continue
		}
		n, _, _ := strings.Cut(strings.TrimPrefix(a, "--"), "=")
		out = append(out, n)
	}
	return out
}

func nested(t *testing.T, m map[string]interface{}, path ...string) interface{} {
	t.Helper()
	v, ok, err := unstructured.NestedFieldNoCopy(m, path...)
	if err != nil || !ok {
		t.Fatalf("values: %s missing (%v)", strings.Join(path, "."), err)
	}
	return v
}

func sprint(v interface{}) string { return fmt.Sprint(v) }
