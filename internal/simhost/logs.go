package simhost

import (
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
)

// CopyLogs copies dir's *.log files to logDir, names prefixed.
func CopyLogs(dir, logDir, prefix string) error {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(logDir, 0o750); err != nil {
		return err
	}
	var errs []error
	for _, e := range ents {
		if e.IsDir() || !strings.HasSuffix(e.Name(), ".log") {
			continue
		}
		errs = append(errs, copyFile(filepath.Join(dir, e.Name()), filepath.Join(logDir, prefix+e.Name())))
	}
	return errors.Join(errs...)
}

func copyFile(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.Create(dst)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}
