package kubevirt

import (
	"errors"
	"slices"
	"strings"

	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
)

// temporaryRefusals are KubeVirt's VM-wide, passing refusals: they name no
// volume's fault and clear by themselves, so they refuse no volume.
var temporaryRefusals = []string{"migration is in progress", "until snapshot", "VMI is not running", "still being processed"}

// Refusal reads a refusal of one volume from the VM's Failure condition: the
// legacy VM controller reports a webhook's denial of its spec update there
// (reason FailedUpdateError) and then retries the same update forever, so
// every request queued behind the refused one waits too. The webhook's
// message names the volume.
func Refusal(vm *kubevirtv1.VirtualMachine, volume string) error {
	if vm == nil {
		return nil
	}
	for _, c := range vm.Status.Conditions {
		if c.Type != kubevirtv1.VirtualMachineFailure || c.Status != "True" {
			continue
		}
		if !strings.Contains(c.Message, "denied the request") || !namesVolume(c.Message, volume) {
			continue
		}
		if slices.ContainsFunc(temporaryRefusals, func(s string) bool { return strings.Contains(c.Message, s) }) {
			continue
		}
		if harvesterOccupied(c.Message) {
			// Harvester's validator may judge from a cache that still
			// shows the volume on the VM it just left (classify.go).
			return &hotplug.PassingRefusal{Err: errors.New(c.Message)}
		}
		return errors.New(c.Message)
	}
	return nil
}

// namesVolume reports whether msg mentions volume as a whole name, so pvc-2
// is not taken for pvc-20.
func namesVolume(msg, volume string) bool {
	for from := 0; ; {
		i := strings.Index(msg[from:], volume)
		if i < 0 {
			return false
		}
		i += from
		end := i + len(volume)
		if (i == 0 || !nameChar(msg[i-1])) && (end == len(msg) || !nameChar(msg[end])) {
			return true
		}
		from = i + 1
	}
}

func nameChar(b byte) bool {
	return b >= 'a' && b <= 'z' || b >= '0' && b <= '9' || b == '-' || b == '.'
}
