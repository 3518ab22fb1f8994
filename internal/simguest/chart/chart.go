// Package chart reads what the lab takes from the Helm chart's rendered
// output (deploy/harvester-csi-driver.yaml, kept equal to the chart with its
// default values by the chart tests): the CSIDriver, the StorageClass, and the
// command lines of the driver and sidecar containers, so the lab runs the
// components with the flags the chart ships instead of a re-typed copy.
package chart

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"regexp"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/client-go/kubernetes/scheme"
)

// File is the rendered chart, relative to the repository root.
const File = "deploy/harvester-csi-driver.yaml"

// Manifests is what the lab uses from the rendered chart.
type Manifests struct {
	CSIDriver    *storagev1.CSIDriver
	StorageClass *storagev1.StorageClass
	// Controller and Node are the Deployment's and DaemonSet's pod specs.
	Controller *corev1.PodSpec
	Node       *corev1.PodSpec
	// Namespace is the release namespace (the Deployment's).
	Namespace string
}

// Load parses the rendered chart at path.
func Load(path string) (*Manifests, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	return Parse(data)
}

var docSep = regexp.MustCompile(`(?m)^---\s*$`)

// Parse parses a multi-document YAML stream of rendered manifests.
func Parse(data []byte) (*Manifests, error) {
	codecs := serializer.NewCodecFactory(scheme.Scheme)
	dec := codecs.UniversalDeserializer()
	m := &Manifests{}
	for _, doc := range docSep.Split(string(data), -1) {
		if len(bytes.TrimSpace(stripComments([]byte(doc)))) == 0 {
			continue
		}
		obj, _, err := dec.Decode([]byte(doc), nil, nil)
		if err != nil {
			if runtime.IsNotRegisteredError(err) {
				continue // CRD kinds (VolumeSnapshotClass): not needed here
			}
			return nil, fmt.Errorf("chart: %w", err)
		}
		switch o := obj.(type) {
		case *storagev1.CSIDriver:
			m.CSIDriver = o
		case *storagev1.StorageClass:
			m.StorageClass = o
		case *appsv1.Deployment:
			m.Controller = &o.Spec.Template.Spec
			m.Namespace = o.Namespace
		case *appsv1.DaemonSet:
			m.Node = &o.Spec.Template.Spec
		}
	}
	var missing []string
	if m.CSIDriver == nil {
		missing = append(missing, "CSIDriver")
	}
	if m.StorageClass == nil {
		missing = append(missing, "StorageClass")
	}
	if m.Controller == nil {
		missing = append(missing, "controller Deployment")
	}
	if m.Node == nil {
		missing = append(missing, "node DaemonSet")
	}
	if len(missing) > 0 {
		return nil, fmt.Errorf("chart: the rendered chart has no %s", strings.Join(missing, ", "))
	}
	return m, nil
}

func stripComments(doc []byte) []byte {
	var out [][]byte
	for _, l := range bytes.Split(doc, []byte("\n")) {
		if t := bytes.TrimSpace(l); len(t) > 0 && t[0] != '#' {
			out = append(out, l)
		}
	}
	return bytes.Join(out, []byte("\n"))
}

// Args returns container's arguments in spec with $(VAR) references
// expanded from the container's plain env values and from vars (which win),
// as the kubelet expands them.
func Args(spec *corev1.PodSpec, container string, vars map[string]string) ([]string, error) {
	for _, c := range spec.Containers {
		if c.Name != container {
			continue
		}
		env := map[string]string{}
		for _, e := range c.Env {
			if e.ValueFrom == nil {
				env[e.Name] = e.Value
			}
		}
		for k, v := range vars {
			env[k] = v
		}
		out := make([]string, 0, len(c.Args))
		for _, a := range c.Args {
			out = append(out, expand(a, env))
		}
		return out, nil
	}
	return nil, fmt.Errorf("chart: no container %q", container)
}

var varRef = regexp.MustCompile(`\$\(([A-Za-z_][A-Za-z0-9_]*)\)`)

func expand(s string, env map[string]string) string {
	return varRef.ReplaceAllStringFunc(s, func(ref string) string {
		if v, ok := env[ref[2:len(ref)-1]]; ok {
			return v
		}
		return ref
	})
}

// Rewrite returns args with the flags named in set replaced by the given
// value (an empty value drops the flag), the flags in add that args lacks
// appended, and a check that every flag in set was present: a flag the chart
// no longer passes is an error, not a silent difference.
func Rewrite(args []string, set map[string]string, add ...string) ([]string, error) {
	seen := map[string]bool{}
	var out []string
	for _, a := range args {
		name, _, _ := strings.Cut(strings.TrimLeft(a, "-"), "=")
		if v, ok := set[name]; ok {
			seen[name] = true
			if v != "" {
				out = append(out, "--"+name+"="+v)
			}
			continue
		}
		out = append(out, a)
	}
	var errs []error
	for name := range set {
		if !seen[name] {
			errs = append(errs, fmt.Errorf("chart: flag --%s not in %q", name, args))
		}
	}
	for _, a := range add {
		name, _, _ := strings.Cut(strings.TrimLeft(a, "-"), "=")
		has := false
		for _, o := range out {
			n, _, _ := strings.Cut(strings.TrimLeft(o, "-"), "=")
			has = has || n == name
		}
		if !has {
			out = append(out, a)
		}
	}
	return out, errors.Join(errs...)
}
