package chart

import (
	"strings"
	"testing"

	"github.com/harvester-csi/harvester-csi-driver/tests/chart/render"
)

func driverImageValues(repository, tag string, accept bool) map[string]interface{} {
	csiDriver := map[string]interface{}{"repository": repository, "tag": tag}
	if accept {
		csiDriver["acceptRepository"] = true
	}
	return map[string]interface{}{"image": map[string]interface{}{"harvester": map[string]interface{}{"csiDriver": csiDriver}}}
}

// TestChartRefusesAForeignDriverImage: values pinned for the upstream chart
// would run the upstream binary with this chart's flags (a crash loop), so the
// chart refuses them with a message saying what to do; mirrors of this
// driver's image pass, under another name only when the override says so.
func TestChartRefusesAForeignDriverImage(t *testing.T) {
	for _, c := range []struct {
		name, repository, tag string
		accept                bool
		refusal               []string // substrings of the refusal; nil: renders
		image                 string   // the driver image rendered
	}{
		{name: "upstream image pinned", repository: "rancher/harvester-csi-driver", tag: "v0.2.9",
			refusal: []string{`"rancher/harvester-csi-driver" is not this driver's image`, "--reset-then-reuse-values", "acceptRepository=true"}},
		{name: "upstream repository, default tag", repository: "rancher/harvester-csi-driver", tag: "",
			refusal: []string{"rancher/harvester-csi-driver"}},
		{name: "upstream image behind a registry", repository: "registry.local:5000/rancher/harvester-csi-driver", tag: "v0.2.9",
			refusal: []string{"registry.local:5000/rancher/harvester-csi-driver"}},
		{name: "upstream tag on this repository", repository: "harvester-csi/harvester-csi-driver", tag: "v0.2.9",
			refusal: []string{`tag "v0.2.9" is an upstream driver version`}},
		{name: "upstream tag on an accepted mirror", repository: "mirror.example.com/storage/hcsi", tag: "0.1.25", accept: true,
			refusal: []string{`tag "0.1.25"`}},
		{name: "renamed mirror without the override", repository: "mirror.example.com/storage/hcsi", tag: "v0.3.0",
			refusal: []string{"acceptRepository=true"}},
		{name: "renamed mirror with the override", repository: "mirror.example.com/storage/hcsi", tag: "v0.3.0", accept: true,
			image: "mirror.example.com/storage/hcsi:v0.3.0"},
		{name: "this image in a mirror registry", repository: "registry.local:5000/harvester-csi/harvester-csi-driver", tag: "v0.3.1",
			image: "registry.local:5000/harvester-csi/harvester-csi-driver:v0.3.1"},
		{name: "this image, a pre-release", repository: "harvester-csi/harvester-csi-driver", tag: "v0.3.0-rc.1",
			image: "harvester-csi/harvester-csi-driver:v0.3.0-rc.1"},
		{name: "this image, a non-version tag", repository: "harvester-csi/harvester-csi-driver", tag: "main-0123abc",
			image: "harvester-csi/harvester-csi-driver:main-0123abc"},
	} {
		t.Run(c.name, func(t *testing.T) {
			vals := driverImageValues(c.repository, c.tag, c.accept)
			manifest, err := render.Template(loadChart(t), vals)
			if c.refusal != nil {
				if err == nil {
					t.Fatalf("the chart renders the driver image %s:%s", c.repository, c.tag)
				}
				for _, want := range c.refusal {
					if !strings.Contains(err.Error(), want) {
						t.Errorf("refusal %q does not say %q", err, want)
					}
				}
				return
			}
			if err != nil {
				t.Fatalf("refused: %v", err)
			}
			images, err := render.Images(loadChart(t), vals)
			if err != nil {
				t.Fatal(err)
			}
			if !contains(images, c.image) || !strings.Contains(manifest, "image: "+c.image) {
				t.Errorf("images %v, want %s", images, c.image)
			}
		})
	}
}

// TestNotesNameTheKubeconfigFile: the host kubeconfig path in NOTES.txt is
// the directory and the file name joined with one slash, however the
// directory is written.
func TestNotesNameTheKubeconfigFile(t *testing.T) {
	for _, dir := range []string{"/etc/harvester", "/etc/harvester/"} {
		notes, err := render.Notes(loadChart(t), map[string]interface{}{"cloudConfig": map[string]interface{}{"hostPath": dir}})
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(notes, "/etc/harvester/cloud-provider-config on every node") {
			t.Errorf("hostPath %q: NOTES.txt says:\n%s", dir, notes)
		}
	}
}
