package lab

import (
	"testing"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
)

func TestParseKubeVirt(t *testing.T) {
	for name, want := range map[string]struct {
		mode    kubevirtsim.Mode
		version kubevirtsim.Version
	}{
		"":                   {kubevirtsim.ModeLegacy, kubevirtsim.V1_5_3},
		"legacy-v1.5":        {kubevirtsim.ModeLegacy, kubevirtsim.V1_5_3},
		"legacy-v1.7":        {kubevirtsim.ModeLegacy, kubevirtsim.V1_6_3},
		"declarative":        {kubevirtsim.ModeDeclarative, kubevirtsim.V1_7_0},
		"v1.6.3":             {kubevirtsim.ModeLegacy, kubevirtsim.V1_6_3},
		"1.7.0":              {kubevirtsim.ModeDeclarative, kubevirtsim.V1_7_0},
		"legacy-v1.7.0":      {kubevirtsim.ModeLegacy, kubevirtsim.V1_7_0},
		"declarative-v1.8.2": {kubevirtsim.ModeDeclarative, kubevirtsim.V1_8_2},
		"main":               {kubevirtsim.ModeDeclarative, kubevirtsim.VMain},
	} {
		mode, version, err := ParseKubeVirt(name)
		if err != nil || mode != want.mode || version != want.version {
			t.Errorf("ParseKubeVirt(%q) = %s, %s, %v; want %s, %s", name, mode, version, err, want.mode, want.version)
		}
	}
	for _, bad := range []string{"v1.4.0", "declarative-v1.5.3", "legacy-", "nonsense"} {
		if _, _, err := ParseKubeVirt(bad); err == nil {
			t.Errorf("ParseKubeVirt(%q) accepted", bad)
		}
	}
}
