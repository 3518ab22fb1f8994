package lab

import (
	"maps"
	"testing"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
)

// TestWebhookDenialsAreNotConflicts: answers in which an admission webhook
// refused a write are counted apart, and only the rest of the 409s and 422s
// are conflicts.
func TestWebhookDenialsAreNotConflicts(t *testing.T) {
	patchVM := kubevirtsim.RequestKey{Verb: "patch", Group: "kubevirt.io", Resource: "virtualmachines"}
	addVolume := kubevirtsim.RequestKey{Verb: "put", Group: "subresources.kubevirt.io", Resource: "virtualmachines", Subresource: "addvolume"}
	answers := map[kubevirtsim.RequestKey]map[int]int{
		patchVM:   {200: 40, 409: 2, 422: 5},
		addVolume: {202: 10, 422: 1},
	}
	denied := map[kubevirtsim.RequestKey]map[int]int{patchVM: {422: 3}}
	conflicts, denials := answersByRequest(answers, denied)
	wantConflicts := map[string]int{
		"409 patch kubevirt.io/virtualmachines":                      2,
		"422 patch kubevirt.io/virtualmachines":                      2,
		"422 put subresources.kubevirt.io/virtualmachines/addvolume": 1,
	}
	if !maps.Equal(conflicts, wantConflicts) {
		t.Errorf("conflicts %v, want %v", conflicts, wantConflicts)
	}
	if want := map[string]int{"422 patch kubevirt.io/virtualmachines": 3}; !maps.Equal(denials, want) {
		t.Errorf("denials %v, want %v", denials, want)
	}
}
