package chart

import (
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	"github.com/harvester-csi/harvester-csi-driver/tests/chart/render"
)

// upstreamValues are the value paths of the chart RKE2 bundles as
// kube-system/harvester-csi-driver: rancher/rke2 charts/chart_versions.yaml
// pins harvester-csi-driver 0.1.3100, rke2-charts' packaging of harvester/charts
// charts/harvester-csi-driver 0.1.31, whose values.yaml (harvester/charts
// commit 48a577b) has these leaves; rke2-charts' packaging renames
// global.cattle.systemDefaultRegistry to global.systemDefaultRegistry
// (rancher/rke2-charts packages/harvester-csi-driver
// generated-changes/patch/values.yaml.patch). Upstream's templates read no
// other value.
var upstreamValues = []string{
	"replicasCount",
	"image.harvester.csiDriver.repository", "image.harvester.csiDriver.tag",
	"image.csi.nodeDriverRegistrar.repository", "image.csi.nodeDriverRegistrar.tag",
	"image.csi.resizer.repository", "image.csi.resizer.tag",
	"image.csi.provisioner.repository", "image.csi.provisioner.tag",
	"image.csi.attacher.repository", "image.csi.attacher.tag",
	"image.csi.snapshotter.repository", "image.csi.snapshotter.tag",
	"image.pullPolicy",
	"nameOverride", "fullnameOverride",
	"hostStorageClass", "kubeletRootDir",
	"cloudConfig.secretName", "cloudConfig.hostPath",
	"nodeSelector", "tolerations",
	"global.cattle.systemDefaultRegistry", "global.cattle.imagePullSecrets", "global.systemDefaultRegistry",
}

// helmChartConfig is helm.cattle.io/v1 HelmChartConfig as RKE2's
// helm-controller reads it (k3s-io/helm-controller
// pkg/apis/helm.cattle.io/v1/types.go, HelmChartConfigSpec).
type helmChartConfig struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Spec              struct {
		ValuesContent string `json:"valuesContent"`
		FailurePolicy string `json:"failurePolicy,omitempty"`
	} `json:"spec"`
}

// leafPaths lists the dotted paths of v's leaves (a list is a leaf: Helm
// replaces lists whole).
func leafPaths(prefix string, v interface{}) []string {
	m, ok := v.(map[string]interface{})
	if !ok || len(m) == 0 {
		return []string{prefix}
	}
	var out []string
	for k, sub := range m {
		p := k
		if prefix != "" {
			p = prefix + "." + k
		}
		out = append(out, leafPaths(p, sub)...)
	}
	sort.Strings(out)
	return out
}

// TestRKE2HelmChartConfig: deploy/rke2's HelmChartConfig is one RKE2's
// helm-controller applies to its bundled release (kind, name, namespace),
// sets only values upstream's chart has (an unknown value would be ignored
// without a word, leaving upstream's image running), and names this
// driver's image at this version.
func TestRKE2HelmChartConfig(t *testing.T) {
	root := render.RepoRoot()
	data, err := os.ReadFile(filepath.Join(root, "deploy", "rke2", "harvester-csi-driver-helmchartconfig.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var hc helmChartConfig
	if err := yaml.UnmarshalStrict(data, &hc); err != nil {
		t.Fatalf("not a HelmChartConfig: %v", err)
	}
	if hc.APIVersion != "helm.cattle.io/v1" || hc.Kind != "HelmChartConfig" {
		t.Errorf("apiVersion/kind %s/%s, want helm.cattle.io/v1/HelmChartConfig", hc.APIVersion, hc.Kind)
	}
	// RKE2 names the HelmChart after its chart file, in kube-system
	// (rancher/rke2 charts/build-chart.sh), and helm-controller applies a
	// HelmChartConfig of the same name and namespace to it.
	if hc.Name != render.ReleaseName || hc.Namespace != render.Namespace {
		t.Errorf("HelmChartConfig %s/%s, want %s/%s (RKE2's HelmChart)", hc.Namespace, hc.Name, render.Namespace, render.ReleaseName)
	}
	var vals map[string]interface{}
	if err := yaml.UnmarshalStrict([]byte(hc.Spec.ValuesContent), &vals); err != nil {
		t.Fatalf("valuesContent is not YAML: %v", err)
	}
	paths := leafPaths("", vals)
	for _, p := range paths {
		if !slices.Contains(upstreamValues, p) {
			t.Errorf("valuesContent sets %s, which upstream's chart does not have", p)
		}
	}
	for _, p := range []string{"image.harvester.csiDriver.repository", "image.harvester.csiDriver.tag"} {
		if !slices.Contains(paths, p) {
			t.Errorf("valuesContent does not set %s", p)
		}
	}
	version, err := os.ReadFile(filepath.Join(root, "VERSION"))
	if err != nil {
		t.Fatal(err)
	}
	if tag, want := sprint(nested(t, vals, "image", "harvester", "csiDriver", "tag")), "v"+strings.TrimSpace(string(version)); tag != want {
		t.Errorf("image tag %s, want %s (VERSION)", tag, want)
	}
	ours := sprint(nested(t, loadChart(t).Values, "image", "harvester", "csiDriver", "repository"))
	if repo := sprint(nested(t, vals, "image", "harvester", "csiDriver", "repository")); !strings.HasSuffix(repo, "/"+ours) {
		t.Errorf("image repository %s, want <registry>/%s", repo, ours)
	}
}
