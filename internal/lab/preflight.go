package lab

import (
	"fmt"
	"os/exec"
	"slices"
	"strings"
)

// osTool is a command the lab's node plugins or the lab itself run, and the
// Debian package that has it (hack/os-deps.sh installs them).
type osTool struct{ cmd, pkg string }

// neededTools lists what this scenario runs on the machine: loop devices and
// ext4 always, growing filesystems when claims are expanded, and XFS when the
// databases switch to it (see dbStorageClass).
func (c *Config) neededTools(xfs bool) []osTool {
	tools := []osTool{{"losetup", "mount"}, {"mount", "mount"}, {"umount", "mount"}, {"blkid", "util-linux"}, {"mkfs.ext4", "e2fsprogs"}}
	if c.ExpandEvery > 0 {
		tools = append(tools, osTool{"resize2fs", "e2fsprogs"})
	}
	if xfs {
		tools = append(tools, osTool{"mkfs.xfs", "xfsprogs"}, osTool{"xfs_growfs", "xfsprogs"})
	}
	return tools
}

// preflight refuses a scenario this machine cannot run, naming what is
// missing: without the tools every stage of a volume fails, the workload
// never runs, and the run would say nothing useful about the driver.
func preflight(tools []osTool, lookPath func(string) (string, error)) error {
	var missing, pkgs []string
	for _, t := range tools {
		if _, err := lookPath(t.cmd); err != nil {
			missing = append(missing, t.cmd)
			if !slices.Contains(pkgs, t.pkg) {
				pkgs = append(pkgs, t.pkg)
			}
		}
	}
	if len(missing) == 0 {
		return nil
	}
	return fmt.Errorf("this scenario needs %s, missing on this machine: install the packages %s (`make os-deps` as root does)",
		strings.Join(missing, ", "), strings.Join(pkgs, ", "))
}

// lookPath finds a command also in the sbin directories a non-login root
// shell may lack from its PATH.
func lookPath(cmd string) (string, error) {
	if p, err := exec.LookPath(cmd); err == nil {
		return p, nil
	}
	for _, dir := range []string{"/usr/sbin", "/sbin"} {
		if p, err := exec.LookPath(dir + "/" + cmd); err == nil {
			return p, nil
		}
	}
	return "", exec.ErrNotFound
}
