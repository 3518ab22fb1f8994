package chart

import (
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/harvester-csi/harvester-csi-driver/internal/checkout"
)

func TestTheRenderedChartHasWhatTheLabRuns(t *testing.T) {
	root, err := checkout.Root()
	if err != nil {
		t.Fatal(err)
	}
	m, err := Load(filepath.Join(root, File))
	if err != nil {
		t.Fatal(err)
	}
	if m.CSIDriver.Name != "driver.harvesterhci.io" || m.CSIDriver.Spec.AttachRequired == nil || !*m.CSIDriver.Spec.AttachRequired {
		t.Errorf("CSIDriver %s attachRequired %v: the lab needs the chart's attach-required driver", m.CSIDriver.Name, m.CSIDriver.Spec.AttachRequired)
	}
	if m.StorageClass.Provisioner != m.CSIDriver.Name {
		t.Errorf("StorageClass provisioner %q, want %q", m.StorageClass.Provisioner, m.CSIDriver.Name)
	}
	for _, c := range []string{"harvester-csi-driver", "csi-attacher", "csi-provisioner"} {
		args, err := Args(m.Controller, c, map[string]string{"ADDRESS": "/x/csi.sock", "POD_NAMESPACE": "ns"})
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(strings.Join(args, " "), "$(") {
			t.Errorf("%s args keep an unexpanded reference: %q", c, args)
		}
	}
	args, _ := Args(m.Controller, "csi-attacher", map[string]string{"ADDRESS": "/x/csi.sock", "POD_NAMESPACE": "ns"})
	if !slices.Contains(args, "--csi-address=/x/csi.sock") || !slices.Contains(args, "--leader-election-namespace=ns") {
		t.Errorf("attacher args %q: $(ADDRESS) and $(POD_NAMESPACE) not expanded", args)
	}
	if _, err := Args(m.Node, "harvester-csi-driver", nil); err != nil {
		t.Fatal(err)
	}
}

func TestRewrite(t *testing.T) {
	args := []string{"--v=2", "--http-endpoint=:8090", "--leader-election", "--timeout=2m"}
	got, err := Rewrite(args, map[string]string{"http-endpoint": "", "v": "4"}, "--kubeconfig=/k", "--timeout=9m")
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"--v=4", "--leader-election", "--timeout=2m", "--kubeconfig=/k"}
	if !slices.Equal(got, want) {
		t.Fatalf("got %q, want %q (a flag the chart sets is kept, a missing one added, an empty value drops)", got, want)
	}
	if _, err := Rewrite(args, map[string]string{"metrics-address": "x"}); err == nil {
		t.Fatal("rewriting a flag the chart does not pass must fail, not silently add it")
	}
}
